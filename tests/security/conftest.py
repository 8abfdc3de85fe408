"""The security suite's server, attacker and witness (see SECURITY.md and the security spec)."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloche.client.tcp import TCPClient
from cloche.config import Limits
from support import CANARY, ServerThread, make_config, require_gvisor, slowness

# As many times longer as this machine is slower than this project's (an emulated CPU).
SLOW = slowness()
LIMITS = Limits(
    # Generous on purpose: attacks that end by a time limit pass their own (1-3 s); the rest
    # (20 MB of output, a memory bomb) must not hit it on a busy 2-core machine, nor a cell
    # spinning in 17 threads miss its grace after the interrupt there.
    cell_timeout_s=15.0 * SLOW,
    interrupt_grace_s=2.0 * SLOW,
    memory_mib=512,
    nproc=64,
    disk_mib=32,
    output_bytes=100_000,
)


@pytest.fixture(scope="package")
def secure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A gVisor server whose own environment holds a canary secret."""
    require_gvisor()
    os.environ["CLOCHE_SECURITY_CANARY"] = CANARY
    try:
        config = make_config(tmp_path_factory.mktemp("security-state"), limits=LIMITS, pool_size=2)
        with ServerThread(config) as running:
            yield running
    finally:
        del os.environ["CLOCHE_SECURITY_CANARY"]


class Attacker:
    """A connection and a fresh session for one attack: cells over TCP, commands (as root
    inside, unless said otherwise) over HTTP."""

    def __init__(self, server: ServerThread) -> None:
        self.server = server
        self.client = server.client()
        self.session_id = self.client.run("0")["session_id"]
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=120)

    def sh(self, cmd: str, user: str | None = "root", timeout_s: float = 60) -> dict[str, Any]:
        """Run a command line in the session (through its shell); the server's answer."""
        body: dict[str, Any] = {"cmd": cmd, "timeout": timeout_s}
        if user is not None:
            body["user"] = user
        reply = self.http.post(f"/v1/sessions/{self.session_id}/commands", json=body)
        assert reply.status_code == 200, reply.text
        answer: dict[str, Any] = reply.json()
        return answer

    def out(self, cmd: str, user: str | None = "root") -> str:
        """stdout and stderr of a command that must run to its end (whatever its status)."""
        answer = self.sh(cmd, user)
        assert answer["status"] == "exited", answer
        return str(answer["stdout"]) + str(answer["stderr"])

    def run(self, code: str, timeout_s: float | None = None) -> dict[str, object]:
        return self.client.run(code, self.session_id, timeout_s=timeout_s)

    def value(self, code: str) -> str:
        """The echoed value of a cell that must succeed."""
        reply = self.run(code)
        assert reply["status"] == "ok", reply
        return str(reply["output"])


class Witness:
    """A bystander session that keeps running cells while an attack happens elsewhere."""

    # far above normal (~1 ms); an attack must not stall the server
    MAX_LATENCY_S = 2.0 * SLOW

    def __init__(self, server: ServerThread) -> None:
        self.client: TCPClient = server.client()
        self.session_id = self.client.run("w = 0")["session_id"]
        self.count = 0
        self.latencies_s: list[float] = []
        self.errors: list[str] = []
        self.baseline_s = statistics.median(self._cell() for _ in range(10))

    def _cell(self) -> float:
        started = time.perf_counter()
        reply = self.client.run("w += 1; w", self.session_id)
        elapsed = time.perf_counter() - started
        self.count += 1
        if reply.get("output") != f"{self.count}\n":
            self.errors.append(repr(reply))
        return elapsed

    @contextmanager
    def watching(self) -> Iterator[None]:
        stop = threading.Event()
        self.latencies_s = []

        def loop() -> None:
            while not stop.is_set():
                try:
                    self.latencies_s.append(self._cell())
                except Exception as exc:  # collected and asserted below
                    self.errors.append(repr(exc))
                    return

        thread = threading.Thread(target=loop)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(60)
        assert self.errors == [], "the witness session saw wrong answers or failures"
        assert self.latencies_s, "the witness ran no cell during the attack"
        assert max(self.latencies_s) < self.MAX_LATENCY_S, (
            f"witness latency {max(self.latencies_s):.3f} s during the attack"
        )
        # The session still answers correctly afterwards.
        self._cell()
        assert self.errors == []


def assert_server_well(server: ServerThread) -> None:
    """The server is healthy and a new session answers a cell (after any attack)."""
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=120) as http:
        assert http.get("/health").status_code == 200
        created = http.post("/v1/sessions", json={})
        assert created.status_code == 201, created.text
        session = created.json()["id"]
        done = http.post(f"/v1/sessions/{session}/execute", json={"code": "6 * 7"})
        assert done.status_code == 200 and done.json()["result_json"] == 42, done.text
        assert http.delete(f"/v1/sessions/{session}").status_code == 204


@pytest.fixture
def attacker(secure_server: ServerThread) -> Iterator[Attacker]:
    attack = Attacker(secure_server)
    yield attack
    attack.client.close()
    attack.http.close()
    # Whatever the attack did to its own session, the server is well afterwards.
    assert_server_well(secure_server)
    # Each attack gets a fresh session: free it, so idle sandboxes don't pile up.
    manager = secure_server.server.manager
    if attack.session_id in {info.id for info in manager.list()}:
        secure_server.call(manager.close(attack.session_id))


@pytest.fixture
def witness(secure_server: ServerThread) -> Iterator[Witness]:
    bystander = Witness(secure_server)
    yield bystander
    bystander.client.close()
    secure_server.call(secure_server.server.manager.close(bystander.session_id))


@pytest.fixture
def server_source() -> Path:
    import cloche

    return Path(cloche.__file__).resolve().parent
