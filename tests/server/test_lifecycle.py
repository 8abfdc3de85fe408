"""The server's life: start-up, refusals, expiry, shutdown, and recovery after a crash."""

from __future__ import annotations

import re
import signal
import threading
import time
import urllib.request

import pytest

from cloche.config import Limits
from support import NOTHING_LEFT, ServerProcess, leftovers, require_gvisor


@pytest.fixture
def state_dir(tmp_path):
    require_gvisor()
    return tmp_path / "state"


def test_health_answers_ok_while_sandboxes_can_start(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/health") as response:
        assert response.status == 200


def test_sessions_beyond_the_maximum_are_refused_clearly(make_server):
    small = make_server(max_sessions=2, pool_size=1)
    with small.client() as c:
        first = c.run("1")
        second = c.run("2")
        third = c.run("3")
        assert first["status"] == second["status"] == "ok"
        assert third["status"] == "error"
        assert "maximum of 2 sessions" in third["error"]
        assert "--max-sessions" in third["error"]
        assert c.run("1 + 1", first["session_id"])["output"] == "2\n"


def test_idle_sessions_expire_and_then_are_not_found(make_server):
    quick = make_server(pool_size=1, limits=Limits(idle_timeout_s=0.5))
    with quick.client() as c:
        sid = c.run("1")["session_id"]
        deadline = time.monotonic() + 15
        while quick.server.manager.session_count and time.monotonic() < deadline:
            time.sleep(0.1)  # polling the observable state, with a deadline
        assert c.run("1", sid) == {"status": "error", "error": f"Session {sid} not found"}
        assert quick.server.manager.closed_by_reason["idle"] == 1


def test_sigterm_stops_cleanly_and_leaves_nothing(state_dir):
    server = ServerProcess(state_dir)
    with server.client() as c:
        sid = c.run("x = 1")["session_id"]
        assert c.run("x", sid)["output"] == "1\n"
    # One more connection with a cell still running when the signal arrives.
    busy = server.client()
    busy_reply: dict[str, object] = {}

    def run_long() -> None:
        try:
            busy_reply.update(
                busy.run("open('started', 'w').close()\nimport time; time.sleep(60)", sid)
            )
        except Exception as exc:  # the server may close the connection: that's fine
            busy_reply["closed"] = repr(exc)

    thread = threading.Thread(target=run_long)
    thread.start()
    marker = state_dir / server.instance / "sandboxes"
    deadline = time.monotonic() + 30
    while not list(marker.glob("*/work/started")) and time.monotonic() < deadline:
        time.sleep(0.02)  # polling for the cell to be running, with a deadline
    assert server.stop(signal.SIGTERM) == 0
    thread.join(30)
    busy.close()
    assert busy_reply.get("cell_status") == "killed", busy_reply
    assert "was closed (shutdown); the session is gone" in str(busy_reply.get("error"))
    assert any("reason=shutdown" in line and "exit=closed" in line for line in server.log), "".join(
        server.log
    )
    assert leftovers(state_dir, server.instance) == NOTHING_LEFT, "".join(server.log)
    # Every line (written by the log thread, to the end) has one timestamp, level and name.
    line_shape = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+ \S")
    lines = [line for line in server.log if line.strip()]
    assert all(line_shape.match(line) for line in lines), lines[:5]
    assert not any(":cloche." in line for line in lines), "a line was formatted twice"
    assert "stopped" in lines[-1]


def test_a_server_killed_with_sigkill_is_cleaned_up_by_the_next_start(state_dir):
    crashed = ServerProcess(state_dir)
    with crashed.client() as c:
        assert c.run("'busy'")["status"] == "ok"
    instance = crashed.instance
    assert leftovers(state_dir, instance)["cgroups"]  # the live sandboxes have cgroups
    crashed.stop(signal.SIGKILL)

    successor = ServerProcess(state_dir)
    try:
        assert any("cleaning leftovers" in line for line in successor.log)
        assert leftovers(state_dir, instance) == NOTHING_LEFT
        with successor.client() as c:
            assert c.run("1 + 1")["output"] == "2\n"
    finally:
        assert successor.stop() == 0
    assert leftovers(state_dir, successor.instance) == NOTHING_LEFT


def test_missing_runsc_fails_fast_with_a_hint(state_dir, tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "cloche.cli", "serve", "--state-dir", str(state_dir)],
        env={"PATH": str(tmp_path)},  # no runsc on it
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "runsc was not found" in done.stderr
    assert "--backend unsafe-local" in done.stderr
