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
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from cloche.client.tcp import TCPClient
from cloche.config import Limits, ServerConfig
from cloche.protocol.framing import encode_frame
from cloche.sandbox import mounts
from cloche.sandbox.gvisor import GVisorBackend, GVisorSandbox
from cloche.server.app import Server

T = TypeVar("T")

# What `cloche serve` mounts by default: .runtime/site-packages beside the virtualenv.
DEFAULT_RUNTIME_DIR = Path(sys.prefix).parent / ".runtime" / "site-packages"

# Echo whatever arrives on fd 0 back to fd 1; one byte first, to say it is up.
ECHO_LOOP = (
    "import os\n"
    "os.write(1, b'R')\n"
    "while True:\n"
    "    data = os.read(0, 65536)\n"
    "    if not data:\n"
    "        break\n"
    "    os.write(1, data)\n"
)
# A frame like the host sends the kernel: 4-byte length + JSON, 47 bytes in all.
MESSAGE = encode_frame({"op": "exec", "code": "1+1", "output_limit": 1})
WARMUP_S = 1.5  # clock_gettime traps for about a sandbox's first second (vDSO calibration)
BLOCK = 100  # floor round trips and warm cells alternate in blocks of this many


# -- statistics and the tables --------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    """Summary of one sample set, in the unit it was taken in."""

    n: int
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        if not samples:
            raise ValueError("no samples")
        if len(samples) == 1:
            only = samples[0]
            return cls(1, only, only, only, only)
        cuts = statistics.quantiles(samples, n=100, method="inclusive")
        return cls(len(samples), cuts[49], cuts[89], cuts[98], max(samples))


@dataclass(frozen=True)
class Row:
    what: str
    unit: str
    stats: Stats


@dataclass(frozen=True)
class Verdict:
    target: str
    measured: str
    verdict: str


def fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def render(verdicts: list[Verdict], rows: list[Row], markdown: bool) -> str:
    """The targets table (ratios first), then every measurement."""
    target_table = [
        ["target", "measured", "verdict"],
        *([v.target, v.measured, v.verdict] for v in verdicts),
    ]
    latency_table = [
        ["measurement", "unit", "n", "p50", "p90", "p99", "max"],
        *(
            [
                r.what,
                r.unit,
                str(r.stats.n),
                fmt(r.stats.p50),
                fmt(r.stats.p90) if r.stats.n >= 10 else "-",  # too few samples to mean much
                fmt(r.stats.p99) if r.stats.n >= 20 else "-",
                fmt(r.stats.max),
            ]
            for r in rows
        ),
    ]
    return "\n\n".join(_table(t, markdown) for t in (target_table, latency_table)) + "\n"


def _table(cells: list[list[str]], markdown: bool) -> str:
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    numeric = [i > 0 and all(_is_number(row[i]) for row in cells[1:]) for i in range(len(widths))]

    def line(row: list[str]) -> str:
        parts = [
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, right in zip(row, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(parts) + " |" if markdown else "  ".join(parts).rstrip()

    if markdown:
        rule = "|" + "|".join(
            "-" * (w + 1) + ":" if right else "-" * (w + 2)
            for w, right in zip(widths, numeric, strict=True)
        )
        rule += "|"
    else:
        rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def _is_number(text: str) -> bool:
    if text == "-":
        return True
    try:
        float(text.replace(",", ""))
    except ValueError:
        return False
    return True


# -- the floor: a runsc sandbox built by cloche's backend, running an echo loop ------------


class CommandSandbox(GVisorSandbox):
    """A cloche gVisor sandbox whose process is `command` instead of the kernel.

    Everything else (rootfs, mounts, working-directory tmpfs, limits, cgroup, runsc flags,
    close, kill, cleanup) is GVisorSandbox's own.
    """

    def __init__(self, backend: GVisorBackend, command: list[str], limits: Limits) -> None:
        super().__init__(backend, backend.new_id(), limits)
        self.command = command


class Echo:
    """Round trips of MESSAGE to an echo process that has already said 'R'."""

    def __init__(self, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        self.write_fd = stdin.fileno()
        self.read_fd = stdout.fileno()

    def once(self) -> None:
        os.write(self.write_fd, MESSAGE)
        got = 0
        while got < len(MESSAGE):
            chunk = os.read(self.read_fd, 65536)
            if not chunk:
                raise RuntimeError("the echo process closed its pipe")
            got += len(chunk)

    def timed(self, count: int) -> list[float]:
        """count round trips, in µs."""
        samples: list[float] = []
        for _ in range(count):
            started = time.perf_counter_ns()
            self.once()
            samples.append((time.perf_counter_ns() - started) / 1000)
        return samples

    def warm_up(self, count: int, min_s: float) -> None:
        until = time.perf_counter() + min_s
        done = 0
        while done < count or time.perf_counter() < until:
            self.once()
            done += 1


def wait_ready(stdout: IO[bytes], what: str, log_text: str = "", timeout_s: float = 30.0) -> None:
    ready, _, _ = select.select([stdout], [], [], timeout_s)
    if not ready or os.read(stdout.fileno(), 1) != b"R":
        raise RuntimeError(f"{what} did not start: {log_text}")


class Floor:
    """cloche's gVisor backend, prepared, with one echo sandbox running."""

    def __init__(self, state_dir: Path) -> None:
        config = ServerConfig(backend="gvisor", state_dir=state_dir, runtime_dir=None)
        self.backend = GVisorBackend(config)
        self.limits = Limits()
        self.sandbox: CommandSandbox | None = None
        self.echo: Echo | None = None

    def __enter__(self) -> Floor:
        try:
            self.backend.prepare()
            self.sandbox = CommandSandbox(
                self.backend, [self.backend.python, "-S", "-c", ECHO_LOOP], self.limits
            )
            self.sandbox.launch()
            wait_ready(self.sandbox.stdout, "the echo sandbox", self.sandbox.startup_log())
            self.echo = Echo(self.sandbox.stdin, self.sandbox.stdout)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close(grace_s=5.0)
            self.sandbox = None
        self.backend.shutdown()

    def cold_run(self) -> float:
        """One attached `runsc run` of `python3 -S -c pass`, start to exit, in ms."""
        sandbox = CommandSandbox(
            self.backend, [self.backend.python, "-S", "-c", "pass"], self.limits
        )
        try:
            started = time.perf_counter()
            sandbox.launch()
            code = sandbox.wait(60.0)
            elapsed = (time.perf_counter() - started) * 1000
            if code != 0:
                raise RuntimeError(f"runsc run exited {code}: {sandbox.startup_log()}")
            return elapsed
        finally:
            sandbox.close(grace_s=5.0)


def measure_unsandboxed(count: int) -> list[float]:
    """The same echo loop as a plain subprocess (no gVisor), for context; in µs."""
    process = subprocess.Popen(
        [sys.executable, "-S", "-c", ECHO_LOOP], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        wait_ready(process.stdout, "the unsandboxed echo process")
        echo = Echo(process.stdin, process.stdout)
        echo.warm_up(max(200, count // 10), 0.2)
        return echo.timed(count)
    finally:
        process.stdin.close()
        process.wait(10)
        process.stdout.close()


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


# -- clean-up checks -----------------------------------------------------------------------


def runsc_processes() -> list[str]:
    done = subprocess.run(["pgrep", "-af", "runsc"], capture_output=True, text=True)
    return [line for line in done.stdout.splitlines() if line.strip()]


def foreign_runsc(base: Path) -> list[str]:
    """runsc processes that this run did not start (another server, another test run)."""
    return [p for p in runsc_processes() if str(base) not in p]


def leftovers(base: Path) -> list[str]:
    """What this run left behind: runsc processes, mounts, cgroups."""
    found = [f"process: {p}" for p in runsc_processes() if str(base) in p]
    found += [f"mount: {p}" for p in mounts.mounts_under(base)]
    # Every state directory this process claimed is named <pid>-<random>.
    found += [f"cgroup: {p}" for p in Path("/sys/fs/cgroup").glob(f"*/cloche/{os.getpid()}-*")]
    return found


def _runsc_root(command_line: str) -> str:
    """The --root of a runsc command line (which server or test run it belongs to)."""
    match = re.search(r"--root[= ](\S+)", command_line)
    return match.group(1) if match else command_line[:120]


@contextmanager
def scratch_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="cloche-bench-"))
    try:
        yield base
    finally:
        # After a crash mid-run, sandboxes of ours may still hold their mounts: their runsc
        # processes name this directory (ours alone, from mkdtemp) on their command lines.
        for pid in processes_mentioning(str(base)):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for point in mounts.mounts_under(base):
            mounts.unmount(point)
        shutil.rmtree(base, ignore_errors=True)


def processes_mentioning(text: str) -> list[int]:
    """Processes (other than this one) whose command line contains text."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


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
        roots = sorted({_runsc_root(p) for p in foreign_after})
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
