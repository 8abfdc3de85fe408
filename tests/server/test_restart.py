"""Restarting a session: a fresh interpreter under the same id, its files and installed
packages kept, a running cell stopped. Against a real gVisor server."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from support import ServerThread, make_config, require_gvisor


@pytest.fixture(scope="module")
def server(state_root) -> Iterator[ServerThread]:
    require_gvisor()
    with ServerThread(make_config(state_root, pool_size=2, tokens=frozenset({"a", "b"}))) as s:
        yield s


def client(server: ServerThread, token: str = "a") -> httpx.Client:  # noqa: S107
    return httpx.Client(
        base_url=f"http://127.0.0.1:{server.http_port}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )


def run(http: httpx.Client, session_id: str, code: str) -> dict[str, object]:
    reply = http.post(f"/v1/sessions/{session_id}/execute", json={"code": code})
    assert reply.status_code == 200, reply.text
    body: dict[str, object] = reply.json()
    return body


def test_a_restart_gives_a_fresh_interpreter_with_the_same_id_and_files(
    server: ServerThread,
) -> None:
    with client(server) as http:
        session = http.post("/v1/sessions", json={}).json()["id"]
        run(http, session, "x = 1\nimport json\nopen('kept.txt', 'w').write('still here')")
        assert run(http, session, "x")["execution_count"] == 2
        restarted = http.post(f"/v1/sessions/{session}/restart")
        assert restarted.status_code == 200, restarted.text
        assert restarted.json()["id"] == session
        assert restarted.json()["execution_count"] == 0
        gone = run(http, session, "x")
        assert gone["error"]["ename"] == "NameError", gone  # type: ignore[index]
        assert gone["execution_count"] == 1
        assert run(http, session, "'json' in dir()")["result"] == {"text/plain": "False"}
        assert run(http, session, "open('kept.txt').read()")["result"] == {
            "text/plain": "'still here'"
        }
        listed = [s["id"] for s in http.get("/v1/sessions").json()["sessions"]]
        assert listed.count(session) == 1
        assert http.delete(f"/v1/sessions/{session}").status_code == 204


def test_a_restart_stops_the_running_cell(server: ServerThread) -> None:
    with client(server) as http:
        session = http.post("/v1/sessions", json={}).json()["id"]
        replies: list[dict[str, object]] = []
        started = threading.Event()

        def long_cell() -> None:
            with client(server) as other:
                started.set()
                replies.append(run(other, session, "import time\ny = 1\ntime.sleep(60)"))

        worker = threading.Thread(target=long_cell)
        worker.start()
        started.wait(30)
        # The restart waits for the cell to be running (a restart before it would meet
        # an idle session): it polls the session's state, bounded.
        for _ in range(600):
            if http.get(f"/v1/sessions/{session}").json()["state"] == "busy":
                break
            threading.Event().wait(0.05)
        assert http.post(f"/v1/sessions/{session}/restart").status_code == 200
        worker.join(60)
        assert replies and replies[0]["status"] == "interrupted", replies
        assert run(http, session, "'y' in dir()")["result"] == {"text/plain": "False"}
        assert http.delete(f"/v1/sessions/{session}").status_code == 204


def test_another_token_can_t_restart_a_session(server: ServerThread) -> None:
    with client(server) as http, client(server, "b") as stranger:
        session = http.post("/v1/sessions", json={}).json()["id"]
        assert stranger.post(f"/v1/sessions/{session}/restart").status_code == 404
        assert http.post("/v1/sessions/nope/restart").status_code == 404
        assert http.delete(f"/v1/sessions/{session}").status_code == 204
