"""The suite's latencies, one client at a time: a warm cell against the floor, the TCP and
HTTP front ends and an unsandboxed Jupyter, in alternating blocks; one sandbox per cell;
new sessions from the pool and without one, `import pandas`, Terrarium requests.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable

import httpx

from cloche.bench import (
    HTTPCell,
    HTTPSessions,
    NewSession,
    Target,
    TCPNewSession,
    Terrarium,
    Worker,
    http_client,
    measure,
)
from cloche.client.tcp import TCPClient
from floor import WARMUP_S, CommandSandbox, Floor
from serving import Serve
from suite_run import DATA_POOL, POOL, Run

BLOCK = 100


class Jupyter:
    """An ipykernel (no sandbox) and a blocking jupyter_client, as notebooks use them."""

    def __enter__(self) -> Jupyter:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3")
        return self

    def once(self) -> None:
        reply = self.client.execute_interactive("1+1", timeout=30, output_hook=lambda _: None)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"jupyter: {reply['content']}")

    def __exit__(self, *exc: object) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def per_cell_sandbox(floor: Floor, count: int) -> list[float]:
    """A `runsc run` of `python3 -c 'print(1+1)'` for each cell, output read; in ms."""
    samples = []
    for _ in range(count):
        sandbox = CommandSandbox(
            floor.backend, [floor.backend.python, "-c", "print(1+1)"], floor.limits
        )
        try:
            started = time.perf_counter()
            sandbox.launch()
            assert sandbox.stdout is not None
            output = sandbox.stdout.read()
            sandbox.wait(60.0)
            samples.append((time.perf_counter() - started) * 1000)
            if output.strip() != b"2":
                raise RuntimeError(f"one-sandbox-per-cell printed {output!r}")
        finally:
            sandbox.close(grace_s=5.0)
    return samples


def timed(fn: Callable[[], object], count: int) -> list[float]:
    """count calls of fn, in µs."""
    samples = []
    for _ in range(count):
        started = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - started) / 1000)
    return samples


def single_client_latencies(
    floor: Floor, server: Serve, jupyter: Jupyter, count: int
) -> dict[str, list[float]]:
    """Floor, TCP, HTTP and Jupyter round trips (µs), in alternating blocks of BLOCK."""
    assert floor.echo is not None
    echo = floor.echo
    with (
        httpx.Client(base_url=server.target.url, timeout=60) as http,
        TCPClient("127.0.0.1", server.tcp_port) as tcp,
    ):
        session_id = http.post("/v1/sessions", json={}).json()["id"]

        def tcp_cell() -> None:
            reply = tcp.run("1+1", session_id)
            if reply.get("output") != "2\n":
                raise RuntimeError(f"TCP cell: {reply}")

        def http_cell() -> None:
            reply = http.post(f"/v1/sessions/{session_id}/execute", json={"code": "1+1"})
            if reply.status_code != 200 or reply.json()["result"]["text/plain"] != "2":
                raise RuntimeError(f"HTTP cell: {reply.status_code} {reply.text}")

        kinds: dict[str, Callable[[], object]] = {
            "floor": echo.once,
            "tcp": tcp_cell,
            "http": http_cell,
            "jupyter": jupyter.once,
        }
        until = time.perf_counter() + WARMUP_S  # sandboxes trap clock_gettime at first
        while time.perf_counter() < until:
            for fn in kinds.values():
                timed(fn, 20)
        samples: dict[str, list[float]] = {name: [] for name in kinds}
        while len(samples["tcp"]) < count:
            for name, fn in kinds.items():
                samples[name] += timed(fn, min(BLOCK, count - len(samples[name])))
        http.delete(f"/v1/sessions/{session_id}")
    return samples


class CreateOnly(Worker):
    """`POST /v1/sessions` alone, timed; the session is closed after."""

    def __init__(self, target: Target, sessions: HTTPSessions) -> None:
        self.sessions = sessions

    async def once(self) -> float:
        started = time.perf_counter()
        session_id = await self.sessions.create()
        elapsed = time.perf_counter() - started
        await self.sessions.delete(session_id)
        return elapsed


async def new_sessions_missing(server: Serve, count: int) -> list[float]:
    """New sessions from a server with no pool: each starts a sandbox; in ms."""
    async with http_client(server.target, 1) as http:
        sessions = HTTPSessions(server.target, http)
        report = await measure("miss", lambda: NewSession(server.target, sessions), total=count)
    return [s * 1000 for s in report.samples_s]


def new_sessions(run: Run, server: Serve, count: int) -> None:
    async def go() -> None:
        async with http_client(server.target, 4) as http:
            sessions = HTTPSessions(server.target, http)

            async def rest(profile: str, size: int) -> None:
                """Until the pool is full again, and a little more."""
                await asyncio.to_thread(server.wait_pooled, profile, size)
                await asyncio.sleep(0.2)

            async def sample(key: str, make: Callable[[], Worker], profile: str) -> None:
                """`count` operations, each after a rest, into run.samples_ms[key]."""
                size = POOL if profile == "lean" else DATA_POOL
                before = functools.partial(rest, profile, size)
                report = await measure(key, make, total=count, before_each=before)
                run.samples_ms[key] = [s * 1000 for s in report.samples_s]

            for profile in ("lean", "data"):
                target = Target(url=server.target.url, tcp_port=server.tcp_port, profile=profile)
                kinds: dict[str, Callable[[], Worker]] = {
                    f"new_session_{profile}": lambda t=target: NewSession(t, HTTPSessions(t, http)),
                    f"create_only_{profile}": lambda t=target: CreateOnly(t, HTTPSessions(t, http)),
                    f"new_session_tcp_{profile}": lambda t=target: TCPNewSession(
                        t, HTTPSessions(t, http)
                    ),
                }
                for key, make in kinds.items():
                    await sample(key, make, profile)
            # The same rest before a cell of a session that exists: what the pause alone
            # costs (an idle machine's first request after it is slower, whatever it does).
            await sample("cell_after_pause", lambda: HTTPCell(server.target, sessions), "lean")
            data_id = await sessions.create("data")
            try:
                for module in ("numpy", "scipy", "sympy", "matplotlib.pyplot"):
                    await sessions.execute(data_id, f"import {module}")
                trips, inside = [], []
                for _ in range(50):
                    started = time.perf_counter()
                    result = await sessions.execute(data_id, "import pandas")
                    trips.append((time.perf_counter() - started) * 1000)
                    inside.append(float(result["duration_ms"]))
                run.samples_ms["import_pandas_data"] = trips
                run.samples_ms["import_pandas_data_kernel"] = inside
            finally:
                await sessions.delete(data_id)

            await sample("terrarium", lambda: Terrarium(server.target, http), "data")

    asyncio.run(go())
