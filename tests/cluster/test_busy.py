"""A busy session on a cluster's node refuses a streamed execute with 409 before the stream
starts, as one machine does (a cluster of its own, in a process of its own: a second Ray
cluster can't share a test process with another module's)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support import ServerProcess, require_cluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def one_waiting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_cluster()
    state = tmp_path_factory.mktemp("busy-cluster")
    server = ServerProcess(state, "--cluster", "local:1", "--max-queued-cells", "1")
    yield server
    assert server.stop() == 0, "".join(server.log[-30:])


def until(check: Any, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not in {timeout_s} s"
        time.sleep(0.05)  # polling the server's state, with a deadline


def test_a_streamed_execute_to_a_busy_remote_session_is_409_before_the_stream(
    one_waiting: ServerProcess,
) -> None:
    base = f"http://127.0.0.1:{one_waiting.http_port}"
    with httpx.Client(base_url=base, timeout=120) as http:
        session = http.post("/v1/sessions").json()["id"]
        path = f"/v1/sessions/{session}"
        blocking = (
            "import os, time\nopen('started', 'w').close()\n"
            "while not os.path.exists('go'):\n    time.sleep(0.01)\n'first'"
        )
        answers: dict[str, Any] = {}

        def run(name: str, code: str) -> None:
            with httpx.Client(base_url=base, timeout=120) as own:
                answers[name] = own.post(f"{path}/execute", json={"code": code}).json()

        threads = [threading.Thread(target=run, args=("first", blocking))]
        threads[0].start()
        try:
            until(lambda: http.get(f"{path}/files/started").status_code == 200, "first cell")
            threads.append(threading.Thread(target=run, args=("second", "'second'")))
            threads[1].start()
            until(lambda: http.get(path).json()["queued_cells"] == 1, "the second cell queued")
            plain = http.post(f"{path}/execute", json={"code": "'third'"})
            assert plain.status_code == 409 and plain.json()["error"]["type"] == "busy"
            streamed = http.post(f"{path}/execute?stream=true", json={"code": "'third'"})
            assert streamed.status_code == 409, streamed.text
            assert streamed.json()["error"]["type"] == "busy"
        finally:
            http.put(f"{path}/files/go", content=b"")
            for thread in threads:
                thread.join(120)
        assert answers["first"]["result_json"] == "first"
        assert answers["second"]["result_json"] == "second"
        # A stream the node accepts opens as before.
        with http.stream("POST", f"{path}/execute?stream=true", json={"code": "1"}) as ok:
            assert ok.status_code == 200
            assert "event: done" in ok.read().decode()
