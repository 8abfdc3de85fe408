"""Core latency benchmark: cloche against the floor of a runsc sandbox's pipes, in one run.

    .venv/bin/python benchmarks/bench_core.py [--cells N] [--sessions N] [--markdown FILE]

Measures, on this machine (as root, with runsc on PATH):

1. The floor: the round trip of a 47-byte frame through a runsc sandbox's stdin/stdout
   pipes, to a tiny echo loop instead of the kernel. The sandbox is built by cloche's own
   gVisor backend (same rootfs, mounts, limits, cgroup, runsc flags); only the command
   differs. For context: the same echo loop as a plain subprocess, and a cold
   `runsc run` of `python3 -S -c pass`.
2. cloche: a real server (gVisor backend) in this process, on a background thread. Warm
   cells (`1+1` over TCP, one session), new sessions from a warm pool (every sample a pool
   hit: the pool is refilled and the machine quiet before each), and new sessions with no
   pool (pool_size=0: every sample starts a sandbox).

The floor and the warm cells are measured in alternating blocks, so that both see the
same machine: on a shared VM, wake-up latencies drift by 2-5x from minute to minute.

Everything it starts is stopped and its temporary directory removed; at the end it checks
that no runsc process is left and warns if one is.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from cleanup import foreign_runsc, leftovers, runsc_root, scratch_dir
from cloche.client.tcp import TCPClient
from cloche.config import ServerConfig
from cloche.server.app import Server
from core_report import Row, Stats, Verdict, render
from floor import WARMUP_S, Echo, Floor, measure_unsandboxed

T = TypeVar("T")

# What `cloche serve` mounts by default: .runtime/site-packages beside the virtualenv.
DEFAULT_RUNTIME_DIR = Path(sys.prefix).parent / ".runtime" / "site-packages"

BLOCK = 100  # floor round trips and warm cells alternate in blocks of this many


# -- cloche: a real server on a background thread ------------------------------------------


class ServerThread:
    """A real cloche Server on its own event loop in a thread (as tests/support.py does)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.server = Server(config)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        try:
            self.call(self.server.start())
            self.call(self.server.manager.pool.wait_full())
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            try:
                self.call(self.server.stop())
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(30)
                self.loop.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout_s)

    def client(self) -> TCPClient:
        assert self.server.tcp.port is not None
        return TCPClient("127.0.0.1", self.server.tcp.port)

    def close_session(self, session_id: str) -> None:
        self.call(self.server.manager.close(session_id))


def server_config(state_dir: Path, pool_size: int) -> ServerConfig:
    return ServerConfig(
        tcp_port=0,
        http_port=0,
        backend="gvisor",
        pool_size=pool_size,  # `lean` sessions: nothing imported, what the TCP protocol gets
        data_pool_size=0,  # no `data` sandbox importing the data stack during measurements
        state_dir=state_dir,
        runtime_dir=DEFAULT_RUNTIME_DIR if DEFAULT_RUNTIME_DIR.is_dir() else None,
    )


def run_cell(client: TCPClient, code: str, session_id: str | None = None) -> dict[str, Any]:
    reply = client.run(code, session_id)
    if reply.get("status") != "ok":
        raise RuntimeError(f"cell {code!r} failed: {reply}")
    return reply


def timed_cells(client: TCPClient, session_id: str, count: int) -> list[float]:
    """count warm `1+1` cells, in µs."""
    samples: list[float] = []
    for _ in range(count):
        started = time.perf_counter_ns()
        reply = client.run("1+1", session_id)
        samples.append((time.perf_counter_ns() - started) / 1000)
        if reply.get("output") != "2\n":
            raise RuntimeError(f"unexpected reply to 1+1: {reply}")
    return samples


def measure_floor_and_cells(
    echo: Echo, server: ServerThread, client: TCPClient, count: int
) -> tuple[list[float], list[float]]:
    """(floor round trips, warm cells), in µs, taken in alternating blocks."""
    session_id = str(run_cell(client, "1+1")["session_id"])
    warm_until = time.perf_counter() + WARMUP_S
    done = 0
    while done < max(100, count // 10) or time.perf_counter() < warm_until:
        run_cell(client, "1+1", session_id)
        done += 1
    echo.warm_up(max(200, count // 10), 0.0)
    floor: list[float] = []
    cells: list[float] = []
    while len(cells) < count:
        block = min(BLOCK, count - len(cells))
        floor += echo.timed(block)
        cells += timed_cells(client, session_id, block)
    server.close_session(session_id)
    return floor, cells


def measure_pool_hits(
    server: ServerThread, client: TCPClient, count: int, settle_s: float
) -> list[float]:
    """New sessions (with one cell), each taken from a full pool; in ms."""
    pool = server.server.manager.pool
    hits_before = pool.hits
    samples: list[float] = []
    for _ in range(count):
        server.call(pool.wait_full())
        time.sleep(settle_s)  # let the refill's sandbox start finish its work
        started = time.perf_counter_ns()
        reply = run_cell(client, "1")
        samples.append((time.perf_counter_ns() - started) / 1e6)
        server.close_session(str(reply["session_id"]))
    if pool.hits - hits_before != count:
        raise RuntimeError(f"only {pool.hits - hits_before} of {count} new sessions hit the pool")
    return samples


def measure_pool_misses(state_dir: Path, count: int, settle_s: float) -> list[float]:
    """New sessions (with one cell) from a server with no pool: each starts a sandbox; ms."""
    with ServerThread(server_config(state_dir, 0)) as server, server.client() as client:
        samples: list[float] = []
        for _ in range(count):
            time.sleep(settle_s)
            started = time.perf_counter_ns()
            reply = run_cell(client, "1")
            samples.append((time.perf_counter_ns() - started) / 1e6)
            server.close_session(str(reply["session_id"]))
        if server.server.manager.pool.misses != count:
            raise RuntimeError("the pool_size=0 server counted fewer misses than samples")
    return samples


# -- main ----------------------------------------------------------------------------------


@dataclass
class Results:
    floor: list[float]
    cells: list[float]
    plain: list[float]
    cold: list[float]
    hits: list[float]
    misses: list[float]


def measure(
    base: Path, args: argparse.Namespace, progress: Callable[[str, float], None]
) -> Results:
    with Floor(base / "floor") as floor:
        assert floor.echo is not None
        started = time.perf_counter()
        cold = [floor.cold_run() for _ in range(args.cold_runs)]
        plain = measure_unsandboxed(args.cells)
        progress("cold runs and unsandboxed echo", started)
        started = time.perf_counter()
        with (
            ServerThread(server_config(base / "server", args.pool_size)) as server,
            server.client() as client,
        ):
            progress("server start (pool full)", started)
            started = time.perf_counter()
            floor_samples, cells = measure_floor_and_cells(floor.echo, server, client, args.cells)
            progress("floor and warm cells", started)
            started = time.perf_counter()
            hits = measure_pool_hits(server, client, args.sessions, args.settle)
            progress("new sessions, pool hits", started)
    started = time.perf_counter()
    misses = measure_pool_misses(base / "nopool", args.misses, args.settle)
    progress("new sessions, pool misses", started)
    return Results(floor_samples, cells, plain, cold, hits, misses)


def verdicts_and_rows(results: Results, pool_size: int) -> tuple[list[Verdict], list[Row]]:
    floor, cells, hits = Stats.of(results.floor), Stats.of(results.cells), Stats.of(results.hits)
    ratio = cells.p50 / floor.p50
    verdicts = [
        Verdict(
            "warm cell p50 within 2x the floor p50",
            f"{ratio:.1f}x ({cells.p50:.0f} / {floor.p50:.0f} µs)",
            "met"
            if ratio <= 2
            else f"MISSED by {ratio / 2:.1f}x ({cells.p50 - 2 * floor.p50:.0f} µs over 2x)",
        ),
        Verdict(
            "warm cell p50 under 1 ms",
            f"{cells.p50 / 1000:.3f} ms",
            "met" if cells.p50 < 1000 else f"MISSED by {cells.p50 / 1000 - 1:.3f} ms",
        ),
        Verdict(
            "new session from the pool p50 under 10 ms",
            f"{hits.p50:.1f} ms (incl. one cell)",
            "met" if hits.p50 < 10 else f"MISSED by {hits.p50 - 10:.1f} ms",
        ),
    ]
    rows = [
        Row("floor: 47 B round trip through runsc pipes (echo loop)", "µs", floor),
        Row("context: same echo loop, no sandbox", "µs", Stats.of(results.plain)),
        Row("cloche: warm cell `1+1` over TCP, one session", "µs", cells),
        Row(f"cloche: new session, pool hit (pool {pool_size}), incl. one cell", "ms", hits),
        Row(
            "cloche: new session, pool miss (pool 0), incl. one cell",
            "ms",
            Stats.of(results.misses),
        ),
        Row("cold `runsc run` of `python3 -S -c pass`", "ms", Stats.of(results.cold)),
    ]
    return verdicts, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--cells", type=int, default=2000, help="timed warm cells (and floor)")
    parser.add_argument("--sessions", type=int, default=20, help="timed new sessions (pool hits)")
    parser.add_argument("--misses", type=int, default=5, help="timed new sessions with no pool")
    parser.add_argument("--cold-runs", type=int, default=5, help="timed cold `runsc run`s")
    parser.add_argument("--pool-size", type=int, default=4, help="the server's warm pool")
    parser.add_argument(
        "--settle", type=float, default=0.2, help="quiet seconds before each new-session sample"
    )
    parser.add_argument(
        "--server-log",
        choices=("info", "off"),
        default="info",
        help="info: log as `cloche serve` does by default (to a file); off: warnings only",
    )
    parser.add_argument("--markdown", type=Path, help="also write the tables as markdown here")
    args = parser.parse_args(argv)
    if min(args.cells, args.sessions, args.misses, args.cold_runs) < 1 or args.pool_size < 1:
        parser.error("counts and --pool-size must be at least 1")
    if os.geteuid() != 0 or shutil.which("runsc") is None:
        print("bench_core: needs root and runsc on PATH", file=sys.stderr)
        return 2

    load_before = os.getloadavg()[0]
    foreign_seen: set[str] = set()
    with scratch_dir() as base:
        logging.basicConfig(
            level=logging.INFO if args.server_log == "info" else logging.WARNING,
            format="%(asctime)s %(levelname)s %(name)s %(message)s",
            filename=str(base / "server.log") if args.server_log == "info" else None,
        )

        def progress(name: str, started: float) -> None:
            foreign_seen.update(foreign_runsc(base))
            print(f"  {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)

        print("bench_core: measuring...", file=sys.stderr, flush=True)
        foreign_seen.update(foreign_runsc(base))
        results = measure(base, args, progress)
        left = leftovers(base)
        root = logging.getLogger()
        for handler in root.handlers[:]:
            root.removeHandler(handler)
            handler.close()
    if base.exists():
        left.append(f"directory: {base}")
    foreign_after = foreign_runsc(base)

    verdicts, rows = verdicts_and_rows(results, args.pool_size)
    conditions = f"Load average before the run: {load_before:.2f} ({os.cpu_count()} cores); " + (
        f"{len(foreign_seen)} runsc processes of others were seen during the run: the "
        "machine was NOT quiet"
        if foreign_seen
        else "no other runsc process was seen during the run."
    )
    print()
    print(render(verdicts, rows, markdown=False))
    print(conditions)
    if args.markdown is not None:
        args.markdown.write_text(render(verdicts, rows, markdown=True) + "\n" + conditions + "\n")
        print(f"(markdown written to {args.markdown})")
    sys.stdout.flush()

    if left:
        print("\nWARNING: this run left things behind:\n  " + "\n  ".join(left), file=sys.stderr)
    if foreign_after:
        roots = sorted({runsc_root(p) for p in foreign_after})
        print(
            f"\nWARNING: {len(foreign_after)} runsc processes are running that this run did "
            "not start (left alone); their state roots:\n  " + "\n  ".join(roots),
            file=sys.stderr,
        )
    if not left:
        print("clean-up: nothing of this run left (no runsc process, mount, cgroup or file)")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
