"""A session's writable system, against real gVisor: root inside installs into it, the
user can't; it is kept by pause/resume, snapshot/restore, fork (each copy its own) and
restart; it is bounded by --disk-mib (ENOSPC inside, the session lives); --no-root leaves
no root at all."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from cloche.config import Limits
from support import ServerThread, make_config, require_gvisor

LIMITS = Limits(cell_timeout_s=30.0, interrupt_grace_s=1.0, disk_mib=48)


@pytest.fixture(scope="module")
def server(state_root) -> Iterator[ServerThread]:
    require_gvisor()
    with ServerThread(make_config(state_root, pool_size=1, limits=LIMITS)) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=120) as client:
        yield client


def new_session(http: httpx.Client) -> str:
    reply = http.post("/v1/sessions", json={})
    assert reply.status_code == 201, reply.text
    return str(reply.json()["id"])


def sh(http: httpx.Client, session: str, cmd: str, user: str | None = None) -> dict:
    body: dict[str, object] = {"cmd": cmd}
    if user is not None:
        body["user"] = user
    reply = http.post(f"/v1/sessions/{session}/commands", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_root_installs_into_the_system_and_the_user_cannot(http):
    session = new_session(http)
    mine = sh(http, session, "id -u; touch /usr/local/bin/x")
    assert mine["stdout"] == "1000\n" and mine["exit_code"] == 1
    assert "Permission denied" in mine["stderr"]
    root = sh(
        http,
        session,
        "id -u && printf '#!/bin/sh\\necho tool ran\\n' > /usr/local/bin/tool"
        " && chmod 755 /usr/local/bin/tool",
        user="root",
    )
    assert (root["exit_code"], root["stdout"]) == (0, "0\n"), root
    assert sh(http, session, "tool")["stdout"] == "tool ran\n"  # on the user's PATH
    cell = http.post(
        f"/v1/sessions/{session}/execute",
        json={"code": "import os; os.stat('/usr/local/bin/tool').st_uid, os.getuid()"},
    ).json()
    assert cell["result"]["text/plain"] == "(0, 1000)"
    http.delete(f"/v1/sessions/{session}")


def test_the_system_layer_survives_pause_snapshot_fork_and_restart(http):
    session = new_session(http)
    sh(http, session, "echo kept > /usr/local/share/mark && mkdir -p /opt/app", user="root")
    assert http.post(f"/v1/sessions/{session}/pause").status_code == 200
    assert http.get(f"/v1/sessions/{session}").json()["state"] == "paused"
    assert sh(http, session, "cat /usr/local/share/mark")["stdout"] == "kept\n"

    snapshot = http.post(f"/v1/sessions/{session}/snapshot", json={"name": "layer"}).json()["id"]
    restored = http.post("/v1/sessions", json={"snapshot": snapshot}).json()["id"]
    assert sh(http, restored, "cat /usr/local/share/mark")["stdout"] == "kept\n"

    copies = http.post(f"/v1/sessions/{session}/fork", json={"count": 2}).json()["sessions"]
    a, b = (copy["id"] for copy in copies)
    sh(http, a, "echo only-a > /usr/local/share/mark", user="root")
    assert sh(http, a, "cat /usr/local/share/mark")["stdout"] == "only-a\n"
    assert sh(http, b, "cat /usr/local/share/mark")["stdout"] == "kept\n"
    assert sh(http, session, "cat /usr/local/share/mark")["stdout"] == "kept\n"

    assert http.post(f"/v1/sessions/{session}/restart").status_code == 200
    assert sh(http, session, "cat /usr/local/share/mark; ls -d /opt/app")["stdout"] == (
        "kept\n/opt/app\n"
    )
    for each in (session, restored, a, b):
        http.delete(f"/v1/sessions/{each}")
    http.delete(f"/v1/snapshots/{snapshot}")


def test_writing_past_the_disk_limit_is_enospc_inside_and_the_session_lives(http):
    session = new_session(http)
    full = sh(
        http,
        session,
        # Two files, each within RLIMIT_FSIZE (--disk-mib), together past the disk.
        "dd if=/dev/zero of=/fill1 bs=1M count=30 2>&1 && "
        "dd if=/dev/zero of=/usr/local/fill2 bs=1M count=30 2>&1; echo status=$?",
        user="root",
    )
    assert "No space left on device" in full["stdout"], full
    assert "status=1" in full["stdout"]
    cell = http.post(f"/v1/sessions/{session}/execute", json={"code": "6 * 7"}).json()
    assert cell["result_json"] == 42
    sh(http, session, "rm /fill1 /usr/local/fill2", user="root")
    assert sh(http, session, "echo ok > /tmp/after")["exit_code"] == 0
    assert http.get("/health").status_code == 200
    http.delete(f"/v1/sessions/{session}")


def test_a_supervisor_killed_by_a_cell_fails_commands_clearly_and_cells_go_on(make_server):
    """With --no-root the supervisor runs as the session's user, so a cell can kill it:
    then a command is refused with the reason, and the kernel serves cells as before (it
    used to take the failed send for the host gone, and the sandbox ended)."""
    server = make_server(pool_size=1, no_root=True)
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=120) as http:
        session = new_session(http)
        assert sh(http, session, "true")["exit_code"] == 0
        kill = (
            "import os, signal\n"
            "found = [int(p) for p in os.listdir('/proc') if p.isdigit()\n"
            "         and b'procd.run' in open(f'/proc/{p}/cmdline', 'rb').read()]\n"
            "for pid in found:\n"
            "    os.kill(pid, signal.SIGKILL)\n"
            "    try:\n"
            "        os.waitpid(pid, 0)  # the kernel's child: gone, its socket closed\n"
            "    except ChildProcessError:\n"
            "        pass\n"
            "len(found)"
        )
        killed = http.post(f"/v1/sessions/{session}/execute", json={"code": kill}).json()
        assert killed["result_json"] == 1, killed
        refused = http.post(f"/v1/sessions/{session}/commands", json={"cmd": "true"})
        assert refused.status_code == 400, refused.text
        assert "process supervisor has ended" in refused.json()["error"]["message"]
        again = http.post(f"/v1/sessions/{session}/execute", json={"code": "1+1"}).json()
        assert again["result_json"] == 2, again
        http.delete(f"/v1/sessions/{session}")


def test_no_root_refuses_root_and_nothing_inside_has_uid_0(make_server):
    server = make_server(pool_size=1, no_root=True)
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=120) as http:
        session = new_session(http)
        refused = http.post(
            f"/v1/sessions/{session}/commands", json={"cmd": "id -u", "user": "root"}
        )
        assert refused.status_code == 403 and "--no-root" in refused.json()["error"]["message"]
        code = (
            "import os\n"
            "sorted({int(l.split()[1]) for p in os.listdir('/proc') if p.isdigit()"
            " for l in open(f'/proc/{p}/status') if l.startswith('Uid:')})"
        )
        uids = http.post(f"/v1/sessions/{session}/execute", json={"code": code}).json()
        assert uids["result_json"] == [1000], uids
        assert sh(http, session, "id -u")["stdout"] == "1000\n"
