"""cloche against its floor and its alternatives, side by side, in one run on one machine.

    .venv/bin/python benchmarks/suite.py [--quick] [--out benchmarks/results]

Needs root and runsc (./test.sh installs both). In one run it measures:

- the floor: a frame echoed through a runsc sandbox's pipes (cloche's own sandbox set-up,
  an echo loop instead of the kernel), and a cold `runsc run` of `python3 -S -c pass`;
- unsandboxed Jupyter: ipykernel driven by jupyter_client (`execute_interactive`);
- one sandbox per cell: a `runsc run` of `python3 -c 'print(1+1)'` per execution;
- cloche (`cloche serve` in its own process, as users run it): warm cells over TCP and
  HTTP, new sessions from the pool (lean and data) and without one, `import pandas` in a
  data session, Terrarium-style one-shot requests, cells/s and p99 at 1-200 concurrent
  sessions (against the floor's echo with as many sandboxes), memory per idle session
  (PSS of the sandboxes' processes, and the drop of MemAvailable), and whether 500 idle
  sessions leave the server answering.

Single-client latencies are taken in alternating blocks (floor, TCP, HTTP, Jupyter), so
every one of them sees the same machine. Results go to OUT/results.json, OUT/results.md
and PNG plots in OUT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cleanup import foreign_runsc, leftovers, processes_mentioning, scratch_dir
from cloche.bench import (
    HTTPCell,
    HTTPSessions,
    NewSession,
    Target,
    TCPCell,
    TCPNewSession,
    Terrarium,
    Worker,
    http_client,
    measure,
)
from cloche.client.tcp import TCPClient
from cloche.sessions.profiles import PROFILES
from floor import ECHO_LOOP, MESSAGE, WARMUP_S, CommandSandbox, Floor, wait_ready

BLOCK = 100
POOL, DATA_POOL = 4, 1  # the warm pools of the main server
RUNTIME = Path(sys.prefix).parent / ".runtime" / "site-packages"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- a `cloche serve` of our own ------------------------------------------------------------


class Serve:
    """`cloche serve` as a child process on free ports; its log goes to a file.

    The log goes to the file directly: a thread of this process copying it would wake for
    every cell's log line and take the GIL from the clients being timed."""

    def __init__(self, state: Path, *args: str) -> None:
        self.state = state
        state.mkdir(parents=True, exist_ok=True)
        self.log_path = state.with_suffix(".log")
        command = [
            sys.executable,
            "-m",
            "cloche.cli",
            "serve",
            "--tcp-port",
            "0",
            "--http-port",
            "0",
            "--state-dir",
            str(state),
            *args,
        ]
        with self.log_path.open("w") as log_file:
            self.process = subprocess.Popen(command, stderr=log_file)
        until = time.monotonic() + 300
        while not (match := re.search(r"listening tcp=\S+:(\d+) http=\S+:(\d+)", self.log())):
            if self.process.poll() is not None or time.monotonic() > until:
                raise RuntimeError(f"cloche serve did not start; see {self.log_path}")
            time.sleep(0.1)  # polling its log for the line that gives the ports
        self.tcp_port, self.http_port = int(match[1]), int(match[2])
        self.target = Target(url=f"http://127.0.0.1:{self.http_port}", tcp_port=self.tcp_port)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start_times_ms(self, profile: str) -> dict[str, list[float]]:
        """How long the server took to start the profile's sandboxes (from its log): afresh
        (with the preload), restored from its template, and checkpointing the template."""
        text = self.log()
        found = {
            "afresh": rf"sandbox started id=\S+ profile={profile} start_ms=([\d.]+) restored=no",
            "restored": rf"sandbox started id=\S+ profile={profile} start_ms=([\d.]+) restored=yes",
            "template": rf"template made profile={profile} start_ms=([\d.]+)",
            "checkpoint": rf"template made profile={profile} start_ms=\S+ checkpoint_ms=([\d.]+)",
        }
        times = {name: [float(x) for x in re.findall(p, text)] for name, p in found.items()}
        times["afresh"] += times.pop("template")  # the template is a start afresh too
        return times

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.target.url}/metrics", timeout=30).text
        wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pattern = re.escape(name + (f"{{{wanted}}}" if wanted else "")) + r" (\S+)"
        match = re.search("^" + pattern + "$", text, re.MULTILINE)
        return float(match[1]) if match else 0.0

    def wait_pooled(self, profile: str, count: int, timeout_s: float = 300.0) -> None:
        until = time.monotonic() + timeout_s
        while self.metric("cloche_sessions_pooled", profile=profile) < count:
            if time.monotonic() > until:
                raise RuntimeError(f"the {profile} pool did not reach {count}")
            time.sleep(0.25)  # polling /metrics costs the server CPU that a start would use

    def sandbox_pss_kib(self) -> tuple[int, int]:
        """(how many runsc processes, their summed PSS) of this server's sandboxes."""
        return pss_of(self.sandbox_pids())

    def sandbox_pids(self) -> list[int]:
        """runsc processes of this server's sandboxes (the server's own command line names
        its state directory too)."""
        return [p for p in processes_mentioning(str(self.state)) if p != self.process.pid]

    def sandbox_cpu_pct(self, seconds: float) -> float:
        """CPU used by this server's sandbox processes over `seconds`, in % of one core."""

        def ticks() -> int:
            total = 0
            for pid in self.sandbox_pids():
                with contextlib.suppress(OSError, IndexError):
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    total += int(fields[11]) + int(fields[12])  # utime + stime
            return total

        before = ticks()
        time.sleep(seconds)
        return (ticks() - before) / os.sysconf("SC_CLK_TCK") / seconds * 100

    def sandbox_cgroup_mib(self) -> float:
        """Memory charged to this server's sandbox cgroups (cgroup v1: usage_in_bytes,
        which counts gVisor's memory file as PSS can't when no process maps a page)."""
        total = 0
        for lock in self.state.glob("*.lock"):
            top = Path("/sys/fs/cgroup/memory/cloche") / lock.stem
            for usage in top.glob("*/memory.usage_in_bytes"):
                with contextlib.suppress(OSError):
                    total += int(usage.read_text())
        return total / 1024 / 1024

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(120)


@contextlib.contextmanager
def serving(state: Path, *args: str) -> Iterator[Serve]:
    server = Serve(state, *args)
    try:
        yield server
    finally:
        server.stop()


def pss_of(pids: list[int]) -> tuple[int, int]:
    total = 0
    counted = 0
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        match = re.search(r"^Pss:\s+(\d+) kB", rollup, re.MULTILINE)
        if match:
            total += int(match[1])
            counted += 1
    return counted, total


def mem_available_kib() -> int:
    match = re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    assert match
    return int(match[1])


# -- baselines ------------------------------------------------------------------------------


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


class EchoWorker(Worker):
    """The floor of a cell over many sessions: one echo sandbox per worker, driven by
    the same asyncio loop and measuring function as cloche's TCP workers."""

    def __init__(self, sandbox: CommandSandbox) -> None:
        self.sandbox = sandbox
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.WriteTransport | None = None

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.sandbox.stdout is not None and self.sandbox.stdin is not None
        self.reader = asyncio.StreamReader()
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(self.reader), self.sandbox.stdout
        )
        self.writer, _ = await loop.connect_write_pipe(asyncio.Protocol, self.sandbox.stdin)

    async def once(self) -> float:
        assert self.reader is not None and self.writer is not None
        started = time.perf_counter()
        self.writer.write(MESSAGE)
        await self.reader.readexactly(len(MESSAGE))
        return time.perf_counter() - started


class Lease(Worker):
    """An already open worker lent to one measurement (opened and closed by the caller)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def once(self) -> float:
        return await self.worker.once()


def lend(workers: list[Worker]) -> Callable[[], Worker]:
    queue = iter(workers)
    return lambda: Lease(next(queue))


# -- the run --------------------------------------------------------------------------------


@dataclass
class Run:
    """Every figure of one run: samples in their units, and scalar results."""

    latency_us: dict[str, list[float]] = field(default_factory=dict)
    samples_ms: dict[str, list[float]] = field(default_factory=dict)
    throughput: list[dict[str, Any]] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)


def start_echoes(floor: Floor, count: int) -> list[CommandSandbox]:
    """count echo sandboxes, started a few at a time as cloche's pool starts sandboxes."""
    echoes: list[CommandSandbox] = []
    batch = 2 * (os.cpu_count() or 1)
    try:
        for first in range(0, count, batch):
            starting = []
            for _ in range(min(batch, count - first)):
                sandbox = CommandSandbox(
                    floor.backend, [floor.backend.python, "-S", "-c", ECHO_LOOP], floor.limits
                )
                echoes.append(sandbox)
                starting.append(sandbox)
                sandbox.launch()
            for sandbox in starting:
                assert sandbox.stdout is not None
                # Slow when many sandboxes already run: each idle one burns CPU.
                wait_ready(sandbox.stdout, "an echo sandbox", sandbox.startup_log(), 300.0)
    except BaseException:
        for sandbox in echoes:
            sandbox.close(grace_s=5.0)
        raise
    return echoes


async def measure_levels(
    run: Run, name: str, workers: list[Worker], levels: list[int], ops_per_level: int
) -> None:
    for level in levels:
        await measure(name, lend(workers[:level]), total=level * 5, concurrency=level)  # warm
        report = await measure(
            name, lend(workers[:level]), total=max(ops_per_level, 10 * level), concurrency=level
        )
        run.throughput.append({"system": name, "sessions": level, **report.summary()})
        log(
            f"throughput {name} x{level}: {report.throughput:,.0f}/s "
            f"p99 {report.percentile_ms(99):.2f} ms, {report.errors} errors"
        )


def throughput_levels(
    run: Run,
    floor: Floor,
    server: Serve,
    levels: list[int],
    ops_per_level: int,
    floor_max: int | None = None,
) -> None:
    """cells/s and p99 at each level of concurrent sessions: the floor's echo sandboxes
    first (as many as the level, then closed; only up to floor_max), then cloche's sessions
    (as many as the top level, all open at once; idle ones left out of a level are frozen)."""
    top = max(levels)
    for level in levels:
        if floor_max is not None and level > floor_max:
            continue
        # As many echo sandboxes as the level has sessions, and no more: an idle runsc
        # sandbox burns CPU, which would slow the floor down.
        log(f"throughput: starting {level} echo sandboxes")
        echoes = start_echoes(floor, level)
        try:

            async def floor_level(
                echoes: list[CommandSandbox] = echoes, level: int = level
            ) -> None:
                workers: list[Worker] = [EchoWorker(s) for s in echoes]
                for worker in workers:
                    await worker.open()
                await measure_levels(run, "floor", workers, [level], ops_per_level)

            asyncio.run(floor_level())
        finally:
            for sandbox in echoes:
                sandbox.close(grace_s=5.0)

    async def cloche_levels() -> None:
        async with http_client(server.target, top) as http:
            sessions = HTTPSessions(server.target, http)
            workers: list[Worker] = [TCPCell(server.target, sessions) for _ in range(top)]
            log(f"throughput: opening {top} cloche sessions")
            gate = asyncio.Semaphore(2 * (os.cpu_count() or 1))

            async def open_one(worker: Worker) -> None:
                async with gate:
                    await worker.open()

            try:
                await asyncio.gather(*(open_one(w) for w in workers))
                await asyncio.to_thread(server.wait_pooled, "lean", POOL)  # a quiet machine
                await asyncio.to_thread(server.wait_pooled, "data", DATA_POOL)
                await measure_levels(run, "cloche", workers, levels, ops_per_level)
                # While the sessions sit idle: what gVisor burns for nothing.
                await asyncio.sleep(2.0)
                run.memory["idle_cpu_sessions"] = top
                run.memory["idle_cpu_per_session_pct"] = (
                    await asyncio.to_thread(server.sandbox_cpu_pct, 10.0)
                ) / (top + POOL + DATA_POOL)
                log(
                    f"idle CPU per sandbox: {run.memory['idle_cpu_per_session_pct']:.2f}% of a core"
                )
            finally:
                await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)

    asyncio.run(cloche_levels())


def memory_per_session(run: Run, server: Serve, profile: str, count: int) -> None:
    """PSS and MemAvailable per idle session of a profile, from `count` new sessions."""

    async def go() -> None:
        async with http_client(server.target, 4) as http:
            sessions = HTTPSessions(server.target, http)
            await asyncio.to_thread(server.wait_pooled, "lean", POOL)
            await asyncio.to_thread(server.wait_pooled, "data", DATA_POOL)
            await asyncio.sleep(1.0)
            before_pss = server.sandbox_pss_kib()[1]
            before_cgroup = server.sandbox_cgroup_mib()
            before_available = mem_available_kib()
            ids = []
            try:
                for _ in range(count):
                    ids.append(await sessions.create(profile))
                    await sessions.execute(ids[-1], "1+1")
                await asyncio.to_thread(server.wait_pooled, "lean", POOL)
                await asyncio.to_thread(server.wait_pooled, "data", DATA_POOL)
                await asyncio.sleep(2.0)
                after_pss = server.sandbox_pss_kib()[1]
                after_cgroup = server.sandbox_cgroup_mib()
                after_available = mem_available_kib()
            finally:
                for session_id in ids:
                    await sessions.delete(session_id)
        run.memory[f"{profile}_pss_per_session_mib"] = (after_pss - before_pss) / count / 1024
        run.memory[f"{profile}_cgroup_per_session_mib"] = (after_cgroup - before_cgroup) / count
        run.memory[f"{profile}_available_drop_per_session_mib"] = (
            (before_available - after_available) / count / 1024
        )

    asyncio.run(go())


def outside_memory(profile: str) -> float:
    """PSS (MiB) of a plain python3 that did what a profile preloads, outside any sandbox."""
    code = (
        PROFILES[profile].preload
        + "\nimport sys\nsys.stdout.write('R')\nsys.stdout.flush()\nsys.stdin.read()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(RUNTIME), "MPLBACKEND": "Agg"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            f"import sys; sys.path.append({str(RUNTIME)!r})\n" + code,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None
        wait_ready(process.stdout, f"python3 with the {profile} preload")
        return pss_of([process.pid])[1] / 1024
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(30)


def idle_sessions_fit(run: Run, server: Serve, count: int) -> None:
    """Hold `count` idle lean sessions; then check the server still answers promptly."""

    async def go() -> None:
        async with http_client(server.target, 16) as http:
            sessions = HTTPSessions(server.target, http)
            before = mem_available_kib()
            ids: list[str] = []
            gate = asyncio.Semaphore(2 * (os.cpu_count() or 1))

            async def one() -> None:
                async with gate:
                    ids.append(await sessions.create("lean"))

            series: list[dict[str, float]] = []
            base_pss = server.sandbox_pss_kib()[1]

            async def watch() -> None:
                while True:
                    pss = await asyncio.to_thread(server.sandbox_pss_kib)
                    series.append(
                        {
                            "sessions": len(ids),
                            "pss_mib": (pss[1] - base_pss) / 1024,
                            "available_drop_mib": (before - mem_available_kib()) / 1024,
                        }
                    )
                    await asyncio.sleep(2.0)

            watcher = asyncio.create_task(watch())
            started = time.perf_counter()
            results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
            watcher.cancel()
            await asyncio.sleep(2.0)
            pss_now = server.sandbox_pss_kib()[1]
            series.append(
                {
                    "sessions": len(ids),
                    "pss_mib": (pss_now - base_pss) / 1024,
                    "available_drop_mib": (before - mem_available_kib()) / 1024,
                }
            )
            run.memory["series"] = series
            failures = [r for r in results if isinstance(r, BaseException)]
            run.memory["idle_wanted"] = count
            run.memory["idle_created"] = len(ids)
            run.memory["idle_create_failures"] = len(failures)
            run.memory["idle_create_s"] = time.perf_counter() - started
            run.memory["idle_available_drop_gib"] = (before - mem_available_kib()) / 1024 / 1024
            try:
                probe = await measure(
                    "probe", lambda: TCPCell(server.target, sessions), total=200, concurrency=1
                )
                run.memory["idle_probe_p50_ms"] = probe.percentile_ms(50)
                run.memory["idle_probe_errors"] = probe.errors
                health = await http.get("/health")
                run.memory["idle_health"] = health.status_code
            finally:
                gate2 = asyncio.Semaphore(16)

                async def close(session_id: str) -> None:
                    async with gate2:
                        await sessions.delete(session_id)

                await asyncio.gather(*(close(i) for i in ids), return_exceptions=True)

    asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cells", type=int, default=2000, help="single-client round trips")
    parser.add_argument("--sessions", type=int, default=12, help="new-session samples")
    parser.add_argument("--levels", default="1,10,50", help="concurrent sessions")
    parser.add_argument("--ops", type=int, default=3000, help="cells per throughput level")
    parser.add_argument(
        "--floor-max",
        type=int,
        default=None,
        help="measure the floor only at levels up to this (its echo sandboxes are never "
        "frozen: ~80 idle ones saturate 2 cores); default: at every level",
    )
    parser.add_argument("--idle", type=int, default=60, help="idle sessions to hold (0: skip)")
    parser.add_argument(
        "--freeze-idle",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start the main server with --freeze-idle (default: cloche serve's, 30 s)",
    )
    parser.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    parser.add_argument(
        "--cpu-per-cell",
        action="store_true",
        help="only measure CPU per cell by component at --levels busy sessions on each of "
        "--platforms (see benchmarks/cpu_per_cell.py)",
    )
    parser.add_argument("--platforms", default="systrap,ptrace", help="for --cpu-per-cell")
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="for --cpu-per-cell: time per level"
    )
    args = parser.parse_args(argv)
    if args.cpu_per_cell:
        return cpu_per_cell_mode(args)
    if args.quick:
        args.cells, args.sessions, args.levels, args.ops, args.idle = 300, 4, "1,5", 200, 10
    levels = [int(x) for x in args.levels.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run()
    run.facts = machine_facts()
    log(f"machine: {run.facts}")

    def save() -> None:
        """Write what is measured so far (a run cut short keeps its figures)."""
        (args.out / "results.json").write_text(json.dumps(run.__dict__, indent=1))

    run.facts["args"] = vars(args) | {"out": str(args.out)}
    with scratch_dir() as base:
        try:
            measure_all(run, base, args, levels, save)
        finally:
            left = leftovers(base)
            if left:
                log("LEFT BEHIND: " + "; ".join(left))
    run.facts["foreign_runsc_after"] = len(foreign_runsc(Path("/nonexistent")))
    (args.out / "results.json").write_text(json.dumps(run.__dict__, indent=1))
    from report import write_report

    write_report(run.__dict__, args.out)
    log(f"results in {args.out}")
    return 0


def cpu_per_cell_mode(args: argparse.Namespace) -> int:
    """The --cpu-per-cell mode: its table on stdout, its rows in OUT/cpu_per_cell.json."""
    from cpu_per_cell import run_platform, table

    levels = [int(x) for x in args.levels.split(",")]
    rows: list[dict[str, Any]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    with scratch_dir() as base:
        try:
            for platform_name in args.platforms.split(","):
                rows += run_platform(serving, base, platform_name, levels, args.seconds)
                (args.out / "cpu_per_cell.json").write_text(json.dumps(rows, indent=1))
        finally:
            left = leftovers(base)
            if left:
                log("LEFT BEHIND: " + "; ".join(left))
    print(table(rows))
    return 0


def measure_all(
    run: Run, base: Path, args: argparse.Namespace, levels: list[int], save: Callable[[], None]
) -> None:
    with Floor(base / "floor") as floor:
        log("cold runsc starts and one sandbox per cell")
        run.samples_ms["cold_runsc"] = [floor.cold_run() for _ in range(max(3, args.sessions // 2))]
        run.samples_ms["sandbox_per_cell"] = per_cell_sandbox(floor, max(3, args.sessions // 2))
        max_sessions = max(levels) + args.idle + 50
        with serving(
            base / "server",
            "--pool-size", str(POOL),
            "--data-pool-size", str(DATA_POOL),
            "--max-sessions", str(max_sessions),
            *(() if args.freeze_idle is None else ("--freeze-idle", str(args.freeze_idle))),
        ) as server, Jupyter() as jupyter:  # fmt: skip
            server.wait_pooled("lean", POOL)
            server.wait_pooled("data", DATA_POOL)
            log("single-client latency: floor, TCP, HTTP, Jupyter")
            run.latency_us.update(single_client_latencies(floor, server, jupyter, args.cells))
            save()
            log("new sessions from the pool, import pandas, Terrarium")
            new_sessions(run, server, args.sessions)
            save()
            log("throughput")
            throughput_levels(run, floor, server, levels, args.ops, args.floor_max)
            save()
            log("memory per idle session")
            memory_per_session(run, server, "lean", 10)
            memory_per_session(run, server, "data", 3)
            run.memory["lean_outside_pss_mib"] = outside_memory("lean")
            run.memory["data_outside_pss_mib"] = outside_memory("data")
            save()
            if args.idle:
                log(f"holding {args.idle} idle sessions")
                idle_sessions_fit(run, server, args.idle)
            for profile in ("lean", "data"):
                for how, times in server.start_times_ms(profile).items():
                    run.samples_ms[f"pool_start_{profile}_{how}"] = times
    save()
    log("new sessions without a pool")
    with serving(base / "nopool", "--pool-size", "0", "--data-pool-size", "0") as server:
        run.samples_ms["new_session_miss"] = asyncio.run(
            new_sessions_missing(server, max(3, args.sessions // 4))
        )


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


def machine_facts() -> dict[str, Any]:
    meminfo = Path("/proc/meminfo").read_text()
    total = re.search(r"MemTotal:\s+(\d+)", meminfo)
    runsc = subprocess.run(["runsc", "--version"], capture_output=True, text=True).stdout
    return {
        "cpus": os.cpu_count(),
        "mem_total_gib": round(int(total[1]) / 1024 / 1024, 1) if total else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "runsc": runsc.splitlines()[0] if runsc else "?",
        "load_before": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


if __name__ == "__main__":
    sys.exit(main())
