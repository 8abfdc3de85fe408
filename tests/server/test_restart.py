"""Restart without loss: a stopped server pauses its sessions, the next one resumes them;
a killed one loses only the sessions that were live."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from support import NOTHING_LEFT, ServerProcess, fresh_data_dir, leftovers, require_gvisor

TOKENS = ("--token", "ta", "--token", "tb")


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    require_gvisor()
    return tmp_path / "state"


def http_of(server: ServerProcess, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=f"http://127.0.0.1:{server.http_port}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=120,
    )


def test_sessions_come_back_after_a_graceful_restart(state_dir):
    data = fresh_data_dir(state_dir)
    first = ServerProcess(state_dir, "--data-dir", str(data), *TOKENS)
    try:
        with first.client() as tcp:
            made = tcp.request({"code": "x = 40", "token": "ta"})
            tcp_sid = made["session_id"]
            assert (
                tcp.request({"code": "x += 1", "session_id": tcp_sid, "token": "ta"})["status"]
                == "ok"
            )
        with http_of(first, "tb") as http:
            http_sid = http.post("/v1/sessions", json={}).json()["id"]
            cell = {"code": "import itertools\ncounter = itertools.count(5)\nnext(counter)"}
            assert http.post(f"/v1/sessions/{http_sid}/execute", json=cell).json()["status"] == "ok"
            before = http.get(f"/v1/sessions/{http_sid}").json()
        # A cell still running when the signal comes is interrupted, then its session paused.
        busy = first.client()
        reply: dict[str, object] = {}
        running = threading.Thread(
            target=lambda: reply.update(
                busy.request(
                    {
                        "code": "open('started', 'w').close()\nimport time\ntime.sleep(60)",
                        "session_id": tcp_sid,
                        "token": "ta",
                    }
                )
            )
        )
        running.start()
        deadline = time.monotonic() + 60
        while not list((state_dir / first.instance / "sandboxes").glob("*/disk/work/started")):
            assert time.monotonic() < deadline
            time.sleep(0.02)  # polling for the cell to run, with a deadline
    finally:
        assert first.stop(signal.SIGTERM) == 0
    running.join(60)
    busy.close()
    assert reply.get("cell_status") == "interrupted", reply
    assert "KeyboardInterrupt" in str(reply.get("error"))
    paused = [line for line in first.log if "session paused" in line and "reason=shutdown" in line]
    assert len(paused) == 2, "".join(first.log)
    assert leftovers(state_dir, first.instance) == NOTHING_LEFT

    second = ServerProcess(state_dir, "--data-dir", str(data), *TOKENS)
    try:
        with http_of(second, "tb") as http:
            again = http.get(f"/v1/sessions/{http_sid}").json()
            assert again["state"] == "paused"
            assert {k: again[k] for k in ("id", "created_at", "execution_count", "profile")} == {
                k: before[k] for k in ("id", "created_at", "execution_count", "profile")
            }
            assert [s["id"] for s in http.get("/v1/sessions").json()["sessions"]] == [http_sid]
            answer = http.post(
                f"/v1/sessions/{http_sid}/execute", json={"code": "next(counter)"}
            ).json()
            assert answer["result"]["text/plain"] == "6" and answer["execution_count"] == 2
            # The other token's session is not this one's to see.
            assert http.get(f"/v1/sessions/{tcp_sid}").status_code == 404
        with second.client() as tcp:  # an existing client just goes on sending its id
            assert (
                tcp.request({"code": "x", "session_id": tcp_sid, "token": "ta"})["output"] == "41\n"
            )
            assert (
                tcp.request({"code": "x", "session_id": tcp_sid, "token": "tb"})["error"]
                == f"Session {tcp_sid} not found"
            )
        assert any("session resumed" in line for line in second.log)
    finally:
        assert second.stop(signal.SIGTERM) == 0
    assert leftovers(state_dir, second.instance) == NOTHING_LEFT


def test_after_a_crash_live_sessions_are_lost_and_paused_ones_and_snapshots_survive(state_dir):
    data = fresh_data_dir(state_dir)
    crashed = ServerProcess(state_dir, "--data-dir", str(data))
    with httpx.Client(base_url=f"http://127.0.0.1:{crashed.http_port}", timeout=120) as http:
        live, kept = (http.post("/v1/sessions", json={}).json()["id"] for _ in range(2))
        for sid in (live, kept):
            cell = {"code": f"name = {sid!r}"}
            assert http.post(f"/v1/sessions/{sid}/execute", json=cell).json()["status"] == "ok"
        snapshot = http.post(f"/v1/sessions/{live}/snapshot").json()["id"]
        assert http.post(f"/v1/sessions/{kept}/pause").json()["state"] == "paused"
    instance = crashed.instance
    crashed.stop(signal.SIGKILL)

    successor = ServerProcess(state_dir, "--data-dir", str(data))
    try:
        assert leftovers(state_dir, instance) == NOTHING_LEFT  # cleaned at start-up
        with successor.client() as tcp:
            reply = tcp.run("name", live)
            assert (reply["status"], reply["error"]) == (
                "error",
                f"Session {live} was lost when the server stopped unexpectedly",
            )
            assert tcp.run("name", kept)["output"] == f"{kept!r}\n"
        with httpx.Client(base_url=f"http://127.0.0.1:{successor.http_port}", timeout=120) as http:
            lost = http.get(f"/v1/sessions/{live}")
            assert lost.status_code == 410 and lost.json()["error"]["type"] == "lost"
            copy = http.post("/v1/sessions", json={"snapshot": snapshot}).json()["id"]
            answer = http.post(f"/v1/sessions/{copy}/execute", json={"code": "name"}).json()
            assert answer["result"]["text/plain"] == repr(live)
    finally:
        assert successor.stop(signal.SIGTERM) == 0
    assert leftovers(state_dir, successor.instance) == NOTHING_LEFT


def test_two_servers_cannot_share_a_data_dir(state_dir):
    data = fresh_data_dir(state_dir)
    first = ServerProcess(state_dir, "--data-dir", str(data))
    try:
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "cloche.cli",
                "serve",
                "--tcp-port",
                "0",
                "--http-port",
                "0",
                "--state-dir",
                str(state_dir),
                "--data-dir",
                str(data),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2
        assert "in use by another cloche server" in second.stderr
        assert "--data-dir" in second.stderr
    finally:
        assert first.stop() == 0
    assert leftovers(state_dir, first.instance) == NOTHING_LEFT
