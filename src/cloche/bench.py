"""The load generator behind `cloche bench`: latency percentiles and throughput of a server.

A workload is a kind of simulated client (`Worker`). `measure` opens `concurrency` of them,
lets them take operations from a shared count until `total` are done, and reports every
operation's latency, the errors and the wall time. The benchmark suite in `benchmarks/`
drives the same function with its own workers (the runsc floor, Jupyter), so that cloche
and its baselines are timed by the same loop.
"""

from __future__ import annotations

import abc
import asyncio
import json
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from cloche.errors import ClocheError
from cloche.protocol.framing import HEADER, decode_body, encode_frame


class BenchError(ClocheError):
    """An operation of the benchmark failed: a wrong answer, an error reply, a refusal."""


@dataclass(frozen=True)
class Target:
    """Where the server under test listens, and how to authenticate."""

    url: str = "http://127.0.0.1:8080"
    tcp_host: str = "127.0.0.1"
    tcp_port: int = 8000
    token: str | None = None
    profile: str = "lean"
    code: str = "1+1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


class Worker(abc.ABC):
    """One simulated client. `once` does one operation and returns its latency in seconds
    (so that set-up and clean-up around the timed part stay out of the figure)."""

    async def open(self) -> None:  # noqa: B027  # most workers need no set-up
        """Get ready (connect, create a session); not timed."""

    @abc.abstractmethod
    async def once(self) -> float: ...

    async def close(self) -> None:  # noqa: B027
        """Release what `open` took; not timed."""


# -- the server's workloads --------------------------------------------------------------


class HTTPSessions:
    """The sessions API, as the workers use it."""

    def __init__(self, target: Target, http: httpx.AsyncClient) -> None:
        self.target = target
        self.http = http

    async def create(self, profile: str | None = None) -> str:
        reply = await self.http.post(
            "/v1/sessions", json={"profile": profile or self.target.profile}
        )
        _expect(reply, 201)
        return str(reply.json()["id"])

    async def delete(self, session_id: str) -> None:
        reply = await self.http.delete(f"/v1/sessions/{session_id}")
        _expect(reply, 204)

    async def execute(self, session_id: str, code: str) -> dict[str, Any]:
        reply = await self.http.post(f"/v1/sessions/{session_id}/execute", json={"code": code})
        _expect(reply, 200)
        result: dict[str, Any] = reply.json()
        if result.get("status") != "ok":
            raise BenchError(f"the cell failed: {_short(result)}")
        return result


def own_client(shared: httpx.AsyncClient) -> httpx.AsyncClient:
    """A client with one connection, set up as `shared` is, for one worker.

    httpx's pool costs its caller CPU in proportion to its connections: with 100 workers
    sharing one pool, `cloche bench` spent 5.7-7.2 ms of its own CPU per request and
    measured itself (~150 cells/s) instead of the server (~600 with a client each).
    """
    return httpx.AsyncClient(
        base_url=shared.base_url,
        headers=shared.headers,
        timeout=shared.timeout,
        limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
    )


def _expect(reply: httpx.Response, status: int) -> None:
    if reply.status_code != status:
        raise BenchError(f"HTTP {reply.status_code} from {reply.request.url.path}: {reply.text}")


def _short(value: object, limit: int = 300) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


class _TCPWorker(Worker):
    """A client of the REPL TCP protocol, on a connection of its own."""

    def __init__(self, target: Target, sessions: HTTPSessions) -> None:
        self.target = target
        self.sessions = sessions
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(
            self.target.tcp_host, self.target.tcp_port
        )
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await self._receive()  # the greeting

    def _frame(self, **request: Any) -> bytes:
        if self.target.token:
            request["token"] = self.target.token
        return encode_frame({"code": self.target.code, **request})

    async def _round_trip(self, frame: bytes) -> tuple[float, dict[str, Any]]:
        assert self.writer is not None
        started = time.perf_counter()
        self.writer.write(frame)
        reply = await self._receive()
        elapsed = time.perf_counter() - started
        if reply.get("status") != "ok" or reply.get("cell_status", "ok") != "ok":
            raise BenchError(f"the cell failed: {_short(reply)}")
        return elapsed, reply

    async def _receive(self) -> dict[str, Any]:
        assert self.reader is not None
        (length,) = HEADER.unpack(await self.reader.readexactly(HEADER.size))
        return decode_body(await self.reader.readexactly(length))

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class TCPCell(_TCPWorker):
    """Warm cells over the REPL TCP protocol, in a session of its own.

    The session is created and closed through the sessions API (the TCP protocol has no
    close), and used over TCP by id, as an existing TCP client would.
    """

    session_id = ""
    request = b""

    async def open(self) -> None:
        self.session_id = await self.sessions.create()
        await super().open()
        self.request = self._frame(session_id=self.session_id)

    async def once(self) -> float:
        elapsed, _ = await self._round_trip(self.request)
        return elapsed

    async def close(self) -> None:
        await super().close()
        if self.session_id:
            await self.sessions.delete(self.session_id)


class TCPNewSession(_TCPWorker):
    """A TCP request without a session id: a new session and its first cell in one round
    trip. The session is closed through the sessions API after, not timed."""

    async def once(self) -> float:
        elapsed, reply = await self._round_trip(self._frame(profile=self.target.profile))
        await self.sessions.delete(str(reply["session_id"]))
        return elapsed


class HTTPCell(Worker):
    """Warm cells through `POST /v1/sessions/{id}/execute`, in a session of its own."""

    def __init__(self, target: Target, sessions: HTTPSessions) -> None:
        self.target = target
        self.sessions = HTTPSessions(target, own_client(sessions.http))
        self.session_id = ""

    async def open(self) -> None:
        self.session_id = await self.sessions.create()

    async def once(self) -> float:
        started = time.perf_counter()
        await self.sessions.execute(self.session_id, self.target.code)
        return time.perf_counter() - started

    async def close(self) -> None:
        try:
            if self.session_id:
                await self.sessions.delete(self.session_id)
        finally:
            await self.sessions.http.aclose()


class NewSession(Worker):
    """`POST /v1/sessions` then the first cell (`code`), timed; the session is closed after."""

    def __init__(self, target: Target, sessions: HTTPSessions) -> None:
        self.target = target
        self.sessions = HTTPSessions(target, own_client(sessions.http))

    async def close(self) -> None:
        await self.sessions.http.aclose()

    async def once(self) -> float:
        started = time.perf_counter()
        session_id = await self.sessions.create()
        try:
            await self.sessions.execute(session_id, self.target.code)
            return time.perf_counter() - started
        finally:
            await self.sessions.delete(session_id)


class Terrarium(Worker):
    """One-shot requests to the Terrarium-compatible `POST /`."""

    def __init__(self, target: Target, http: httpx.AsyncClient) -> None:
        self.target = target
        self.http = own_client(http)

    async def close(self) -> None:
        await self.http.aclose()

    async def once(self) -> float:
        started = time.perf_counter()
        reply = await self.http.post("/", json={"code": self.target.code})
        elapsed = time.perf_counter() - started
        body = (
            reply.json()
            if reply.headers.get("content-type", "").startswith("application/json")
            else {}
        )
        if reply.status_code != 200 or not body.get("success"):
            raise BenchError(f"HTTP {reply.status_code}: {reply.text[:300]}")
        return elapsed


WORKLOADS: dict[str, str] = {
    "tcp-cell": "warm cells over the TCP protocol, one session per client",
    "http-cell": "warm cells through the sessions API, one session per client",
    "new-session": "create a session and run its first cell (then close it, not timed)",
    "tcp-new-session": "a new session and its first cell in one TCP request (closed after)",
    "terrarium": "one-shot requests to the Terrarium-compatible POST /",
}


def server_workers(workload: str, target: Target, http: httpx.AsyncClient) -> Callable[[], Worker]:
    """A factory of workers for one of WORKLOADS."""
    sessions = HTTPSessions(target, http)
    factories: dict[str, Callable[[], Worker]] = {
        "tcp-cell": lambda: TCPCell(target, sessions),
        "http-cell": lambda: HTTPCell(target, sessions),
        "new-session": lambda: NewSession(target, sessions),
        "tcp-new-session": lambda: TCPNewSession(target, sessions),
        "terrarium": lambda: Terrarium(target, http),
    }
    if workload not in factories:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    return factories[workload]


def http_client(target: Target, concurrency: int, timeout_s: float = 120.0) -> httpx.AsyncClient:
    """An HTTP client with a connection for each concurrent worker."""
    limits = httpx.Limits(
        max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4
    )
    return httpx.AsyncClient(
        base_url=target.url, headers=target.headers, limits=limits, timeout=timeout_s
    )


# -- measuring ---------------------------------------------------------------------------


@dataclass
class Report:
    """Everything one measurement produced."""

    name: str
    concurrency: int
    samples_s: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None
    wall_s: float = 0.0

    @property
    def throughput(self) -> float:
        """Successful operations per second over the whole run."""
        return len(self.samples_s) / self.wall_s if self.wall_s > 0 else 0.0

    def percentile_ms(self, percent: int) -> float:
        return percentile(self.samples_s, percent) * 1000

    def summary(self) -> dict[str, Any]:
        """The figures, in ms and operations per second."""
        figures: dict[str, Any] = {
            "workload": self.name,
            "concurrency": self.concurrency,
            "n": len(self.samples_s),
            "errors": self.errors,
            "throughput_per_s": round(self.throughput, 1),
            "wall_s": round(self.wall_s, 3),
        }
        if self.samples_s:
            for percent in (50, 90, 99):
                figures[f"p{percent}_ms"] = round(self.percentile_ms(percent), 4)
            figures["max_ms"] = round(max(self.samples_s) * 1000, 4)
        if self.first_error:
            figures["first_error"] = self.first_error
        return figures


def percentile(samples: list[float], percent: int) -> float:
    """The percent-th percentile (inclusive method: interpolated between samples)."""
    if not samples:
        raise ValueError("no samples")
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[percent - 1]


class Progress:
    """A one-line progress bar on a terminal (nothing when the stream isn't one)."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self.started = time.perf_counter()
        self.shown_at = 0.0

    def update(self, done: int, errors: int) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.shown_at < 0.1 and done < self.total):
            return
        self.shown_at = now
        width = 30
        filled = width * done // max(self.total, 1)
        rate = done / max(now - self.started, 1e-9)
        bar = "#" * filled + "." * (width - filled)
        failed = f" {errors} errors" if errors else ""
        self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {rate:,.0f}/s{failed} ")
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


async def measure(
    name: str,
    make_worker: Callable[[], Worker],
    *,
    total: int,
    concurrency: int = 1,
    warmup: int = 0,
    progress: Progress | None = None,
    pause_s: float = 0.0,
    before_each: Callable[[], Awaitable[None]] | None = None,
) -> Report:
    """`total` operations by `concurrency` workers; `warmup` more first, not counted.

    `before_each` (awaited before every timed operation, outside its time) lets a caller
    wait for a condition, such as a full warm pool; `pause_s` is a rest between operations.
    """
    if total < 1 or concurrency < 1:
        raise ValueError("total and concurrency must be at least 1")
    report = Report(name, concurrency)
    workers = [make_worker() for _ in range(concurrency)]
    opened: list[Worker] = []
    try:
        for opening in asyncio.as_completed([_opened(worker) for worker in workers]):
            opened.append(await opening)
        remaining = [warmup]

        async def warm(worker: Worker) -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                await worker.once()

        await asyncio.gather(*(warm(worker) for worker in opened))
        left = [total]

        async def run(worker: Worker) -> None:
            while left[0] > 0:
                left[0] -= 1
                if before_each is not None:
                    await before_each()
                try:
                    report.samples_s.append(await worker.once())
                except (BenchError, httpx.HTTPError, OSError, asyncio.IncompleteReadError) as exc:
                    report.errors += 1
                    report.first_error = report.first_error or f"{type(exc).__name__}: {exc}"
                if progress is not None:
                    progress.update(len(report.samples_s) + report.errors, report.errors)
                if pause_s:
                    await asyncio.sleep(pause_s)

        started = time.perf_counter()
        await asyncio.gather(*(run(worker) for worker in opened))
        report.wall_s = time.perf_counter() - started
    finally:
        if progress is not None:
            progress.finish()
        # Every worker, opened or not: some hold a client from the start.
        await asyncio.gather(*(worker.close() for worker in workers), return_exceptions=True)
    return report


async def _opened(worker: Worker) -> Worker:
    await worker.open()
    return worker


def render(reports: list[Report], *, scaling: bool = False) -> str:
    """A fixed-width table of reports, one row each (latencies in ms). With scaling, a last
    column gives each row's ops/s against the first row of the same workload."""
    header = ["workload", "clients", "n", "errors", "p50", "p90", "p99", "max", "ops/s"]
    if scaling:
        header.append("vs first")
    rows = [header]
    first: dict[str, float] = {}
    for report in reports:
        figures = report.summary()
        rows.append(
            [
                report.name,
                str(report.concurrency),
                str(figures["n"]),
                str(report.errors),
                *(
                    f"{figures[key]:.3f}" if key in figures else "-"
                    for key in ("p50_ms", "p90_ms", "p99_ms", "max_ms")
                ),
                f"{report.throughput:,.1f}",
            ]
        )
        if scaling:
            base = first.setdefault(report.name, report.throughput)
            rows[-1].append(f"{report.throughput / base:.2f}x" if base else "-")
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
