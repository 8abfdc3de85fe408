"""A session's disk saved beside its checkpoint: what comes back, and what is refused."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from cloche.sandbox import archive


@pytest.fixture(autouse=True, params=["filters", "no-filters"])
def python_with_or_without_tar_filters(request, monkeypatch):
    """Each test twice: with tarfile's filters (3.11.4+), and as on a Python without them
    (Debian bookworm's 3.11.2, the container image's). On a Python without them, the first
    would only repeat the second."""
    if request.param == "filters" and not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python's tarfile has no extraction filters (before 3.11.4)")
    if request.param == "no-filters":
        monkeypatch.setattr(archive, "_FILTERS", False)


def test_files_links_and_fifos_come_back_with_their_owners_and_modes(tmp_path):
    source = tmp_path / "disk"
    (source / "work" / "sub").mkdir(parents=True)
    (source / "work" / "sub" / "data.csv").write_text("a,b\n")
    (source / "work" / "run.sh").write_text("#!/bin/sh\n")
    (source / "work" / "run.sh").chmod(0o755)
    os.symlink("/etc/hostname", source / "work" / "inside-the-sandbox")
    os.symlink("sub/data.csv", source / "work" / "relative")
    os.mkfifo(source / "work" / "pipe")
    (source / "upper" / "usr" / "local").mkdir(parents=True)
    (source / "upper" / "usr" / "local" / "tool").write_text("root's")
    (source / "upper" / "usr" / "local" / "tool").chmod(0o4755)
    os.chown(source / "work", 1000, 1000)
    for path in (source / "work").rglob("*"):
        os.chown(path, 1000, 1000, follow_symlinks=False)
    saved = tmp_path / "disk.tar"
    assert archive.pack(source, saved) == saved.stat().st_size
    assert saved.stat().st_mode & 0o777 == 0o600

    target = tmp_path / "again"
    target.mkdir()
    archive.unpack(saved, target)
    work = target / "work"
    assert (work / "sub" / "data.csv").read_text() == "a,b\n"
    assert os.access(work / "run.sh", os.X_OK)
    assert (
        os.readlink(work / "inside-the-sandbox") == "/etc/hostname"
    )  # a link, not the host's file
    assert (work / "relative").read_text() == "a,b\n"
    assert (work / "pipe").is_fifo()
    for path in [work, *work.rglob("*")]:
        assert os.lstat(path).st_uid == 1000 and os.lstat(path).st_gid == 1000, path
    tool = target / "upper" / "usr" / "local" / "tool"
    assert (tool.stat().st_uid, tool.stat().st_mode & 0o7777) == (0, 0o4755)


def test_an_overlays_whiteouts_and_opaque_directories_come_back(tmp_path):
    """A layer's deletions (a character device 0:0) and a directory made anew over the
    template's (opaque: an extended attribute) are the layer's meaning: both are kept."""
    source = tmp_path / "disk"
    (source / "upper" / "etc" / "fresh").mkdir(parents=True)
    os.mknod(source / "upper" / "etc" / "gone", 0o600 | stat.S_IFCHR, os.makedev(0, 0))
    os.setxattr(source / "upper" / "etc" / "fresh", "trusted.overlay.opaque", b"y")
    saved = tmp_path / "disk.tar"
    archive.pack(source, saved)
    target = tmp_path / "again"
    target.mkdir()
    archive.unpack(saved, target)
    gone = os.lstat(target / "upper" / "etc" / "gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == os.makedev(0, 0)
    opaque = os.getxattr(target / "upper" / "etc" / "fresh", "trusted.overlay.opaque")
    assert opaque == b"y"


def test_leave_out_skips_the_overlays_scratch(tmp_path):
    source = tmp_path / "disk"
    (source / ".ovl-upper" / "work").mkdir(parents=True)
    (source / "upper").mkdir()
    saved = tmp_path / "disk.tar"
    archive.pack(source, saved, leave_out=lambda name: name.startswith(".ovl-"))
    with tarfile.open(saved) as tar:
        assert tar.getnames() == ["upper"]


def _tar(tmp_path: Path, *members: tuple[tarfile.TarInfo, bytes]) -> Path:
    path = tmp_path / "evil.tar"
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)
    return path


def _file(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def _link(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


@pytest.mark.parametrize(
    "members",
    [
        [(_file("../escaped"), b"x")],
        [(_link("out", str(Path("/").resolve())), b""), (_file("out/escaped-through-link"), b"x")],
    ],
    ids=["dotdot", "through-a-symlink"],
)
def test_entries_that_would_land_outside_are_refused(tmp_path, members):
    target = tmp_path / "target"
    target.mkdir()
    evil = _tar(tmp_path, *members)
    before = set(tmp_path.parent.iterdir())
    with pytest.raises(tarfile.TarError):
        archive.unpack(evil, target)
    assert set(tmp_path.parent.iterdir()) == before
    assert not (tmp_path / "escaped").exists()
    assert not Path("/escaped-through-link").exists()


def test_absolute_names_land_inside_and_devices_are_refused(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    archive.unpack(_tar(tmp_path, (_file("/etc/cloche-test-absolute"), b"x")), target)
    assert (target / "etc" / "cloche-test-absolute").read_bytes() == b"x"
    assert not Path("/etc/cloche-test-absolute").exists()
    device = tarfile.TarInfo("null")
    device.type, device.devmajor, device.devminor = tarfile.CHRTYPE, 1, 3
    with pytest.raises(tarfile.TarError):
        archive.unpack(_tar(tmp_path, (device, b"")), target)
    assert not (target / "null").exists()
