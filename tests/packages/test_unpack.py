"""Unpacking a wheel never writes outside the site directory (zip-slip), nor follows links."""

from __future__ import annotations

import os

import pytest

from cloche.errors import PackageInstallError
from cloche.packages.unpack import unpack
from cloche.sandbox.files import WorkdirFiles
from packages.wheels import make_wheel, symlink_entry


@pytest.fixture
def site(tmp_path):
    directory = tmp_path / "disk" / "site"
    directory.mkdir(parents=True)
    return WorkdirFiles(directory, None, None, 1 << 24)


def files_under(path):
    return sorted(
        os.path.relpath(os.path.join(root, name), path)
        for root, _, names in os.walk(path)
        for name in names
    )


def test_a_wheel_is_unpacked_with_its_purelib_data_and_without_its_scripts(tmp_path, site):
    wheel = make_wheel(
        tmp_path,
        "nice",
        files={
            "nice/__init__.py": "X = 1\n",
            "nice-1.0.data/purelib/nice_extra.py": "Y = 2\n",
            "nice-1.0.data/scripts/nice-cli": "#!/bin/sh\n",
            "nice.pth": "import sys\n",
        },
    )
    written, pth = unpack(wheel, site)
    assert written > 0 and pth == ["nice.pth"]
    assert files_under(site.root) == [
        "nice-1.0.dist-info/METADATA",
        "nice-1.0.dist-info/RECORD",
        "nice-1.0.dist-info/WHEEL",
        "nice.pth",
        "nice/__init__.py",
        "nice_extra.py",
    ]


@pytest.mark.parametrize(
    "evil",
    [
        ("../escaped.py", "x"),
        ("nice/../../escaped.py", "x"),
        ("/tmp/cloche-escaped-abs.py", "x"),  # noqa: S108
        ("C:/escaped.py", "x"),
        ("nice\\..\\..\\escaped.py", "x"),
        symlink_entry("nice/link"),
        symlink_entry("escaped-link"),
    ],
)
def test_a_wheel_whose_entries_escape_is_refused_and_nothing_is_written(tmp_path, site, evil):
    (tmp_path / "wheels").mkdir()
    wheel = make_wheel(tmp_path / "wheels", "evil", evil=[evil])
    before = files_under(tmp_path)
    with pytest.raises(PackageInstallError, match="refused"):
        unpack(wheel, site)
    assert files_under(site.root) == []
    assert files_under(tmp_path) == before
    assert not os.path.exists("/tmp/cloche-escaped-abs.py")  # noqa: S108


def test_a_symlink_the_sandbox_planted_in_the_site_directory_is_not_followed(tmp_path, site):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, site.root / "nice")
    wheel = make_wheel(tmp_path, "nice")
    with pytest.raises(PackageInstallError, match="could not be unpacked"):
        unpack(wheel, site)
    assert os.listdir(outside) == []


def test_a_broken_archive_is_refused(tmp_path, site):
    path = tmp_path / "broken-1.0-py3-none-any.whl"
    path.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(PackageInstallError, match="not a valid wheel"):
        unpack(path, site)
