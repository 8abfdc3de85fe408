"""`cloche volumes` as a user runs it: subprocesses against a real server. Files go in and
out of a volume without a session; `cloche sessions create --volume` mounts one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support import ServerThread, make_config, require_gvisor

pytestmark = pytest.mark.timeout(600)
CLOCHE = Path(sys.executable).parent / "cloche"
TOKEN = "cli-volumes"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_gvisor()
    state = tmp_path_factory.mktemp("cli-volumes-state")
    with ServerThread(make_config(state, pool_size=1, tokens=frozenset({TOKEN}))) as running:
        yield f"http://127.0.0.1:{running.http_port}"


def cloche(url: str, *argv: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOCHE_")}
    return subprocess.run(
        [str(CLOCHE), *argv, "--url", url, "--token", TOKEN],
        capture_output=True,
        input=stdin,
        timeout=300,
        env=env,
        check=False,
    )


def test_create_put_mount_get_list_and_delete(url: str, tmp_path: Path) -> None:
    made = cloche(url, "volumes", "create", "cli", "--size-mib", "8")
    assert made.returncode == 0, made.stderr
    assert made.stdout == b"cli\n"
    local = tmp_path / "in.csv"
    local.write_text("a,b\n1,2\n")
    assert cloche(url, "volumes", "put", "cli", str(local), "data/in.csv").returncode == 0
    piped = cloche(url, "volumes", "put", "cli", "-", "piped.txt", stdin=b"from stdin")
    assert piped.returncode == 0, piped.stderr
    listed = cloche(url, "volumes", "ls", "cli")
    assert listed.stdout.decode().split() == ["8", "data/in.csv", "10", "piped.txt"]
    session = cloche(url, "sessions", "create", "--volume", "cli:/home/user/cli:ro")
    assert session.returncode == 0, session.stderr
    session_id = session.stdout.decode().strip()
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        ran = http.post(
            f"/v1/sessions/{session_id}/execute",
            json={"code": "open('/home/user/cli/data/in.csv').read()"},
            timeout=300,
        )
        assert ran.json()["result_json"] == "a,b\n1,2\n"
    table = cloche(url, "volumes", "list").stdout.decode().splitlines()
    assert table[0].split()[:3] == ["NAME", "SIZE", "MiB"]
    assert table[1].split()[:2] == ["cli", "8"] and table[1].split()[3] == "1"
    as_json = json.loads(cloche(url, "volumes", "list", "--json").stdout)
    assert as_json[0]["sessions"] == [session_id]
    busy = cloche(url, "volumes", "delete", "cli")
    assert busy.returncode == 2 and b"close them first" in busy.stderr
    assert cloche(url, "sessions", "close", session_id).returncode == 0
    assert cloche(url, "volumes", "get", "cli", "piped.txt").stdout == b"from stdin"
    out = tmp_path / "out.csv"
    assert cloche(url, "volumes", "get", "cli", "data/in.csv", str(out)).returncode == 0
    assert out.read_text() == "a,b\n1,2\n"
    assert cloche(url, "volumes", "delete", "cli").stdout == b"deleted cli\n"
    assert cloche(url, "volumes", "list", "--json").stdout.strip() == b"[]"


def test_refusals_are_one_line_and_exit_2(url: str) -> None:
    missing = cloche(url, "volumes", "ls", "nope")
    assert missing.returncode == 2
    assert missing.stderr.decode().strip() == "cloche volumes ls: Volume nope not found"
    bad = cloche(url, "volumes", "create", "../x", "--size-mib", "4")
    assert bad.returncode == 2 and bad.stderr.startswith(b"cloche volumes create: ")
    mount = cloche(url, "sessions", "create", "--volume", ":ro")
    assert mount.returncode == 2 and b"--volume is NAME[:PATH][:ro]" in mount.stderr
    nothing = cloche(url, "volumes", "put", "nope", "/no/such/file")
    assert nothing.returncode == 2 and b"/no/such/file" in nothing.stderr
