"""scripts/install.sh: it reads runsc's version, and a second run does no install work."""

from __future__ import annotations

import hashlib
import shutil
import subprocess

import pytest

from support import REPO

INSTALL = REPO / "scripts" / "install.sh"


def parse_runsc_date(version_output: str) -> str:
    """What install.sh's parse_runsc_date makes of this `runsc --version` output."""
    done = subprocess.run(
        ["bash", "-c", f'source "{INSTALL}" && parse_runsc_date'],
        input=version_output,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.parametrize(
    ("output", "date"),
    [
        ("runsc version 0.0~20240729.0\nspec: 1.0.2-dev\n", "20240729"),  # Debian's
        ("runsc version 0.0~20221219.0\nspec: 1.0.2-dev\n", "20221219"),  # bookworm's own
        ("runsc version release-20240729.0\nspec: 1.1.0\n", "20240729"),  # gVisor's release
        ("runsc version release-20250512.0-rc1\n", "20250512"),
        ("runsc version 0.0~git\n", ""),  # no date: install.sh treats it as too old
        ("spec: 1.0.2-dev\n", ""),
    ],
)
def test_runsc_date_is_read_from_every_known_version_string(output: str, date: str) -> None:
    assert parse_runsc_date(output) == date


def _stamp(*paths: str) -> str:
    content = b"".join((REPO / path).read_bytes() for path in paths)
    return hashlib.sha256(content).hexdigest()[:16]


def _installed() -> bool:
    """True when a previous install.sh run (./test.sh's) left stamps matching this tree."""
    wanted_venv = _stamp("pyproject.toml")
    venv_stamps = list((REPO / ".venv").glob(".cloche-installed*"))
    runtime_stamp = REPO / ".runtime" / ".installed"
    return (
        any(s.is_file() and s.read_text().strip() == wanted_venv for s in venv_stamps)
        and runtime_stamp.is_file()
        and runtime_stamp.read_text().strip() == _stamp("runtime-requirements.txt")
    )


def test_a_second_install_run_does_no_install_work() -> None:
    if shutil.which("runsc") is None or not _installed():
        # Running it here would install into the (possibly shared) .venv: only after a first run.
        pytest.skip("install.sh has not run on this tree yet (./test.sh runs it first)")
    # The newest stamp says which extras the last run installed: ask for the same again.
    newest = max((REPO / ".venv").glob(".cloche-installed*"), key=lambda p: p.stat().st_mtime)
    extras = newest.name.removeprefix(".cloche-installed").strip("[]")
    flags = [f"--{extra}" for extra in extras.split(",") if extra]
    done = subprocess.run(
        [str(INSTALL), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "install" not in done.stderr, done.stderr  # no "installing ...", no "installed"
    assert "warning" not in done.stderr, done.stderr
    assert done.stdout == ""
