"""Wheels that attack the host: zip-slip entries, and code that would run if the host ever
imported or processed the package. Served from a package index the test builds."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import cloche
from packages.conftest import LIMITS, sandbox_of
from packages.wheels import make_wheel, simple_index, symlink_entry
from support import ServerThread

ABSOLUTE = "/tmp/cloche-test-escaped-absolute.py"  # noqa: S108


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp("index")
    wheels = root / "wheels"
    wheels.mkdir()
    marker = root / "host-marker"
    made = [
        make_wheel(wheels, "cloche-test-dotdot", evil=[("../escaped_dotdot.py", "X = 1\n")]),
        make_wheel(wheels, "cloche-test-deep", evil=[("a/../../../escaped_deep.py", "X = 1\n")]),
        make_wheel(wheels, "cloche-test-absolute", evil=[(ABSOLUTE, "X = 1\n")]),
        make_wheel(wheels, "cloche-test-link", evil=[symlink_entry("cloche_test_link/passwd")]),
        make_wheel(
            wheels,
            "cloche-test-pth",
            files={
                "cloche_test_pth/__init__.py": (
                    f"try:\n    open({str(marker) + '-import'!r}, 'w').close()\n"
                    "except OSError:\n    pass\nIMPORTED = True\n"
                ),
                # A .pth line that starts with `import` is run by whoever processes it.
                "cloche_test_pth.pth": (
                    "import builtins, os; builtins.CLOCHE_PTH_RAN = True; "
                    f"os.path.isdir({str(marker.parent)!r}) "
                    f"and open({str(marker)!r}, 'w').close()\n"
                ),
            },
        ),
    ]
    return simple_index(root, made), marker


@pytest.fixture(scope="module")
def hostile_server(state_root, index, package_cache) -> Iterator[ServerThread]:  # type: ignore[no-untyped-def]
    from cloche.config import PackageConfig
    from support import make_config, require_gvisor

    require_gvisor()
    packages = PackageConfig(index_url=index[0], cache_dir=package_cache)
    config = make_config(state_root, pool_size=1, limits=LIMITS, packages=packages)
    with ServerThread(config) as running:
        yield running


@pytest.fixture
def session(hostile_server: ServerThread) -> Iterator[cloche.Session]:
    with cloche.Client(f"http://127.0.0.1:{hostile_server.http_port}") as client:
        with client.create_session() as opened:
            yield opened


def everything_under(path: Path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(root, name), path)
        for root, dirs, names in os.walk(path)
        for name in names + dirs
    )


@pytest.mark.parametrize(
    ("package", "why"),
    [
        ("cloche-test-dotdot", "leaves its directory"),
        ("cloche-test-deep", "leaves its directory"),
        ("cloche-test-absolute", "is an absolute path"),
        ("cloche-test-link", "is a symbolic link"),
    ],
)
def test_a_wheel_whose_archive_escapes_is_refused_and_nothing_is_written(
    hostile_server, session, package, why
):
    sandbox = sandbox_of(hostile_server, session.id)
    session.run("kept = 41")
    before = everything_under(sandbox.disk)
    execution = session.run(f"%pip install {package}")
    assert execution.error is not None and execution.error.ename == "PackageInstallError"
    assert why in execution.error.evalue
    assert everything_under(sandbox.disk) == before
    assert os.listdir(sandbox.site_dir) == []
    assert not os.path.exists(ABSOLUTE)
    assert session.run("kept + 1").text == "42"


def test_the_host_never_runs_package_code_only_the_sandbox_does(hostile_server, index, session):
    _, marker = index
    execution = session.run(
        "%pip install -q cloche-test-pth\n"
        "import builtins, cloche_test_pth\n"
        "builtins.CLOCHE_PTH_RAN, cloche_test_pth.IMPORTED"
    )
    assert execution.error is None, execution.error
    assert execution.logs.stderr == ""
    assert execution.text == "(True, True)"  # its .pth ran and it imported, inside
    site = sandbox_of(hostile_server, session.id).site_dir
    assert (site / "cloche_test_pth.pth").is_file()
    # Neither the .pth nor the module ever ran on the host: their markers are host paths.
    assert not marker.exists()
    assert not Path(str(marker) + "-import").exists()
