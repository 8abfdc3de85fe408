"""`cloche templates` as a user runs it: subprocesses against a real server. `build
--from-tar` sends the local file (so it works against a remote server); `--wait` exits 1 when
the build failed, with the builder's line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from images_support import member, small_root
from support import ServerThread, make_config, require_gvisor

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.geteuid() != 0, reason="building templates needs root (chroot)"),
]
CLOCHE = Path(sys.executable).parent / "cloche"
USER, ADMIN = "cli-user", "cli-admin"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_gvisor()
    state = tmp_path_factory.mktemp("cli-templates-state")
    config = make_config(
        state, pool_size=0, tokens=frozenset({USER}), admin_tokens=frozenset({ADMIN})
    )
    with ServerThread(config) as running:
        yield f"http://127.0.0.1:{running.http_port}"


def cloche(url: str, token: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOCHE_")}
    return subprocess.run(
        [str(CLOCHE), "templates", *argv, "--url", url, "--token", token],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


def test_build_list_show_and_delete(url: str, tmp_path: Path) -> None:
    tarball = small_root(tmp_path / "root.tar")
    done = cloche(url, ADMIN, "build", "tiny", "--from-tar", str(tarball), "--wait")
    assert done.returncode == 0, done.stderr
    assert "building tiny" in done.stderr
    assert "state:          ready" in done.stdout
    assert "user:           user (1000:1000), home /home/user" in done.stdout
    listed = cloche(url, USER, "list")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["NAME", "STATE", "PYTHON", "SIZE", "SOURCE"]
    assert lines[1].startswith("python ") and "builtin" in lines[1]
    assert lines[2].split()[:2] == ["tiny", "ready"] and lines[2].endswith("tar: upload")
    shown = cloche(url, USER, "show", "tiny", "--json")
    assert json.loads(shown.stdout)["state"] == "ready"
    refused = cloche(url, USER, "delete", "tiny")
    assert refused.returncode == 2 and "only an admin may delete templates" in refused.stderr
    deleted = cloche(url, ADMIN, "delete", "tiny")
    assert (deleted.returncode, deleted.stdout) == (0, "deleted tiny\n")
    gone = cloche(url, ADMIN, "show", "tiny")
    assert gone.returncode == 2 and "Template tiny not found" in gone.stderr


def test_a_failed_build_exits_1_with_the_builders_line(url: str, tmp_path: Path) -> None:
    hostile = small_root(tmp_path / "hostile.tar", member("/etc/cron.d/x", data=b"* * * * *"))
    done = cloche(url, ADMIN, "build", "hostile", "--from-tar", str(hostile), "--wait")
    assert done.returncode == 1, done.stderr
    assert "state:          failed" in done.stdout
    assert "member '/etc/cron.d/x': its member name '/etc/cron.d/x' is absolute" in done.stdout
    assert cloche(url, ADMIN, "delete", "hostile").returncode == 0


def test_a_user_cant_build_and_a_bad_source_is_named(url: str, tmp_path: Path) -> None:
    tarball = small_root(tmp_path / "root.tar")
    done = cloche(url, USER, "build", "mine", "--from-tar", str(tarball))
    assert done.returncode == 2 and "only an admin may build templates" in done.stderr
    done = cloche(url, ADMIN, "build", "x", "--from-image", "docker://busybox")
    assert done.returncode == 2 and "the docker: transport is not offered" in done.stderr
    done = cloche(url, ADMIN, "build", "x", "--dockerfile", "relative/Dockerfile")
    assert done.returncode == 2 and "must be absolute" in done.stderr
