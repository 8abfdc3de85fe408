"""Durability: snapshot, pause, resume, restore and fork, a restart with live sessions, and
page-out to disk, against `cloche serve` in one run (issue 12's targets).

    .venv/bin/python benchmarks/bench_durability.py [--lean N] [--data N] [--restart N]
        [--page-out M] [--wake K] [--out DIR]

Needs root and runsc. Each part runs its own `cloche serve` child process (free ports, its
own --state-dir and --data-dir in a scratch directory removed at the end):

1. Latencies, for a lean session and a data session (`--data-pool-size 1`, profile "data"),
   all from the client's side over HTTP: a warm cell (the baseline, same session, same run),
   snapshot, pause, the first cell after the pause (it resumes the session), restore (a new
   session from the snapshot, then its first cell), fork of 1 copy and of 10 copies; and the
   size of an image (a snapshot's `size_bytes`; the bytes a paused session holds under
   --data-dir/sessions/<id>).
2. Restart: N live lean sessions, each holding a value; SIGTERM (the server pauses them all)
   to exit; a new server on the same --data-dir: start to listening, and to all N answering
   their first cell with their value.
3. Page-out: with --pause-idle 1, M idle lean sessions; MemAvailable before they are made
   and once /metrics says all M are paused; bytes on disk per paused session; then K of them
   woken, their values checked.

The machine is shared: the load average is noted at the start and the end. Results go to
OUT/durability.json (every sample) and OUT/durability.md (the tables).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cleanup import foreign_runsc, leftovers, scratch_dir
from serving import Serve, mem_available_kib

GIB = 1024**3
MIB = 1024**2
FORK_MANY = 10
CREATE_WORKERS = 4  # sessions made at once (a sandbox start each, on 2 cores)
ANSWER_WORKERS = 8  # first cells sent at once after a restart


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the HTTP API of one server ------------------------------------------------------------


class Api:
    """The calls this benchmark makes, each checked; a failure raises with the body."""

    def __init__(self, server: Serve) -> None:
        self.server = server
        self.http = httpx.Client(base_url=server.target.url, timeout=600)

    def close(self) -> None:
        self.http.close()

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.http.request(method, path, json=body)
        if response.status_code >= 300:
            raise RuntimeError(f"{method} {path} -> {response.status_code}: {response.text}")
        return response.json() if response.content else None

    def create(self, **body: Any) -> str:
        return str(self.call("POST", "/v1/sessions", body)["id"])

    def cell(self, session_id: str, code: str) -> str:
        """The cell's `text/plain` result ("" if none)."""
        body = self.call("POST", f"/v1/sessions/{session_id}/execute", {"code": code})
        if body["status"] != "ok":
            raise RuntimeError(f"cell {code!r} in {session_id} failed: {body}")
        return str((body.get("result") or {}).get("text/plain", ""))

    def expect(self, session_id: str, code: str, wanted: str) -> None:
        got = self.cell(session_id, code)
        if got != wanted:
            raise RuntimeError(f"{session_id}: {code!r} gave {got!r}, not {wanted!r}")

    def delete(self, session_id: str) -> None:
        self.call("DELETE", f"/v1/sessions/{session_id}")

    def metric(self, name: str) -> float:
        return self.server.metric(name)


def timed_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return (time.perf_counter() - started) * 1000, value


def disk_bytes(path: Path) -> int:
    """Bytes allocated on disk by the files under path (sparse files count what they use)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue  # removed while we walked
    return total


@contextmanager
def serve(state: Path, data: Path, *args: str) -> Iterator[Api]:
    server = Serve(state, "--data-dir", str(data), *args)
    api = Api(server)
    try:
        yield api
    finally:
        api.close()
        server.stop()


def stop_timed(server: Serve, timeout_s: float = 900.0) -> float:
    """SIGTERM to exit, in s; the server pauses every live session before it exits."""
    started = time.perf_counter()
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(timeout_s)
    elapsed = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"the server exited {code} on SIGTERM; see {server.log_path}")
    return elapsed


# -- 1. latencies of one profile --------------------------------------------------------------


@dataclass
class ProfileRun:
    profile: str
    samples_ms: dict[str, list[float]] = field(default_factory=dict)
    snapshot_size_bytes: list[int] = field(default_factory=list)
    snapshot_disk_bytes: list[int] = field(default_factory=list)
    paused_disk_bytes: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # steps the server failed, and why
    rounds_ok: int = 0  # rounds after which the original session still answered
    server_log_problems: list[str] = field(default_factory=list)  # its WARNING/ERROR lines

    def add(self, what: str, ms: float) -> None:
        self.samples_ms.setdefault(what, []).append(ms)


def profile_latencies(api: Api, data_dir: Path, profile: str, count: int) -> ProfileRun:
    """count rounds of warm cell, snapshot, pause, first cell, restore, fork 1, fork 10.

    A step the server fails is recorded (run.failures) and the round goes on without it."""
    run = ProfileRun(profile)

    def fresh() -> str:
        session = api.create(profile=profile)
        api.cell(session, "x = 41")
        for _ in range(3):
            api.expect(session, "x + 1", "42")
        return session

    session = fresh()
    for round_ in range(count):
        snapshot: dict[str, Any] | None = None
        with failing(run, "snapshot, pause and resume"):
            ms, _ = timed_ms(functools.partial(api.expect, session, "x + 1", "42"))
            run.add("warm cell (baseline)", ms)
            ms, snapshot = timed_ms(
                functools.partial(api.call, "POST", f"/v1/sessions/{session}/snapshot")
            )
            assert snapshot is not None
            run.add("snapshot", ms)
            run.snapshot_size_bytes.append(int(snapshot["size_bytes"]))
            run.snapshot_disk_bytes.append(disk_bytes(data_dir / "snapshots" / snapshot["id"]))
            ms, paused = timed_ms(
                functools.partial(api.call, "POST", f"/v1/sessions/{session}/pause")
            )
            if paused["state"] != "paused":
                raise RuntimeError(f"pause answered {paused}")
            run.add("pause", ms)
            run.paused_disk_bytes.append(disk_bytes(data_dir / "sessions" / session))
            ms, _ = timed_ms(functools.partial(api.expect, session, "x + 1", "42"))
            run.add("resume on first cell", ms)
            ms, _ = timed_ms(functools.partial(api.expect, session, "x + 1", "42"))
            run.add("second cell after resume", ms)

        if snapshot is not None:
            with failing(run, "restore"):
                started = time.perf_counter()
                restored = api.create(snapshot=snapshot["id"])
                run.add("restore: POST /v1/sessions", (time.perf_counter() - started) * 1000)
                api.expect(restored, "x + 1", "42")
                run.add("restore + its first cell", (time.perf_counter() - started) * 1000)
                api.delete(restored)
            with failing(run, "snapshot delete"):
                api.call("DELETE", f"/v1/snapshots/{snapshot['id']}")

        for copies in (1, FORK_MANY):
            with failing(run, f"fork of {copies}"):
                fork = functools.partial(
                    api.call, "POST", f"/v1/sessions/{session}/fork", {"count": copies}
                )
                ms, forked = timed_ms(fork)
                made = [s["id"] for s in forked["sessions"]]
                if len(made) != copies:
                    raise RuntimeError(f"fork of {copies} made {len(made)}")
                run.add(f"fork of {copies}: response", ms)
                started = time.perf_counter()
                api.expect(made[0], "x + 1", "42")
                first_ms = (time.perf_counter() - started) * 1000
                run.add(f"fork of {copies}: first copy's first cell", first_ms)
                for copy in made[1:]:
                    api.expect(copy, "x + 1", "42")
                for copy in made:
                    api.delete(copy)
        with failing(run, "the original after the round"):
            api.expect(session, "x + 1", "42")  # the original is unaffected
            run.rounds_ok += 1
        if run.failures and run.failures[-1].startswith("the original"):
            session = fresh()
        log(f"  {profile}: round {round_ + 1}/{count} done ({len(run.failures)} failures so far)")
    api.delete(session)
    return run


@contextmanager
def failing(run: ProfileRun, step: str) -> Iterator[None]:
    """Record a failure of the server in step, and go on."""
    try:
        yield
    except (RuntimeError, httpx.HTTPError) as exc:
        run.failures.append(f"{step}: {exc}")
        log(f"  {run.profile}: FAILED {step}: {exc}")


def latencies(base: Path, lean: int, data: int) -> list[ProfileRun]:
    data_dir = base / "data-latency"
    args = ("--pool-size", "1", "--data-pool-size", "1", "--pause-idle", "0")
    with serve(base / "state-latency", data_dir, *args, "--max-fork", str(FORK_MANY)) as api:
        runs = []
        for profile, count in (("lean", lean), ("data", data)):
            if count > 0:
                api.server.wait_pooled(profile, 1)
                log(f"latencies: {profile} session, {count} rounds")
                runs.append(profile_latencies(api, data_dir, profile, count))
        problems = problem_lines(api.server)
        for run in runs:
            run.server_log_problems = problems
    return runs


def problem_lines(server: Serve, most: int = 40) -> list[str]:
    """The server log's WARNING and ERROR lines (and tracebacks' last lines), the first few."""
    found = [
        line
        for line in server.log().splitlines()
        if " WARNING " in line or " ERROR " in line or line.startswith(("Traceback", "cloche."))
    ]
    return found[:most]


# -- 2. restart with N live sessions ------------------------------------------------------------


@dataclass
class RestartRun:
    sessions: int
    create_s: float = 0.0
    stop_s: float = 0.0  # SIGTERM to exit, pausing all
    shutdown_pauses: int = 0  # "session paused ... reason=shutdown" lines in its log
    shutdown_pause_ms: list[float] = field(default_factory=list)  # the server's own, per session
    fresh_listening_s: float = 0.0  # the first server (empty --data-dir): start to listening
    listening_s: float = 0.0  # the new server's start to its listening line
    all_answered_s: float = 0.0  # the new server's start to the last of N first cells
    first_cell_ms: list[float] = field(default_factory=list)
    second_stop_s: float = 0.0  # SIGTERM of the new server (pausing the N again)
    failures: list[str] = field(default_factory=list)


def create_holding(api: Api, count: int) -> dict[str, str]:
    """count lean sessions, each holding `v`; {session id: repr of its v}."""

    def make(index: int) -> tuple[str, str]:
        session = api.create()
        api.cell(session, f"v = 'value-{index}'")
        return session, repr(f"value-{index}")

    with ThreadPoolExecutor(CREATE_WORKERS) as pool:
        return dict(pool.map(make, range(count)))


def restart(base: Path, count: int, resume_at_start: str = "yes") -> RestartRun:
    run = RestartRun(count)
    data_dir = base / "data-restart"
    args = ["--data-dir", str(data_dir), "--pool-size", "2", "--data-pool-size", "0"]
    args += ["--resume-at-start", resume_at_start]
    args += ["--pause-idle", "0", "--max-sessions", str(count + 10)]
    started = time.perf_counter()
    first = Serve(base / "state-restart-1", *args)
    run.fresh_listening_s = time.perf_counter() - started
    try:
        api = Api(first)
        log(f"restart: making {count} lean sessions")
        started = time.perf_counter()
        held = create_holding(api, count)
        run.create_s = time.perf_counter() - started
        api.close()
        log("restart: SIGTERM")
        run.stop_s = stop_timed(first)
    finally:
        first.stop()
    paused = re.findall(r"session paused id=\S+ reason=shutdown bytes=\d+ ms=([\d.]+)", first.log())
    run.shutdown_pauses = len(paused)
    run.shutdown_pause_ms = [float(ms) for ms in paused]

    started = time.perf_counter()
    second = Serve(base / "state-restart-2", *args)
    try:
        run.listening_s = time.perf_counter() - started
        api = Api(second)

        def answer(item: tuple[str, str]) -> float | None:
            try:
                ms, _ = timed_ms(functools.partial(api.expect, item[0], "v", item[1]))
            except (RuntimeError, httpx.HTTPError) as exc:
                run.failures.append(f"first cell of {item[0]}: {exc}")
                return None
            return ms

        with ThreadPoolExecutor(ANSWER_WORKERS) as pool:
            answered = list(pool.map(answer, held.items()))
        run.first_cell_ms = [ms for ms in answered if ms is not None]
        run.all_answered_s = time.perf_counter() - started
        api.close()
        log("restart: all answered; SIGTERM of the new server")
        run.second_stop_s = stop_timed(second)
    finally:
        second.stop()
    return run


# -- 3. page-out --------------------------------------------------------------------------------


@dataclass
class PageOutRun:
    sessions: int
    mem_available_before_kib: int = 0
    mem_available_after_kib: int = 0
    server_held_before_kib: int = 0  # see held_kib
    server_held_after_kib: int = 0
    create_s: float = 0.0
    all_paused_s: float = 0.0  # from the first session made to /metrics saying all are paused
    disk_bytes: int = 0  # under --data-dir/sessions
    data_dir_metric_bytes: int = 0  # cloche_data_dir_bytes
    wake_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ram_per_session_kib(self) -> float:
        return (self.mem_available_before_kib - self.mem_available_after_kib) / self.sessions

    @property
    def held_per_gib(self) -> float | None:
        per = self.ram_per_session_kib
        return GIB / 1024 / per if per > 0 else None  # None: no drop to measure


def rss_kib(pid: int) -> int:
    match = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(match[1]) if match else 0


def held_kib(server: Serve) -> int:
    """RAM this server holds, counted from its side: its RSS plus its sandboxes' memory
    cgroups (cgroup v1; the cgroup counts gVisor's memory file, which no PSS sees)."""
    total = rss_kib(server.process.pid) * 1024
    for instance in server.state.iterdir():
        top = Path("/sys/fs/cgroup/memory/cloche") / instance.name
        for usage in top.glob("*/memory.usage_in_bytes"):
            try:
                total += int(usage.read_text())
            except (OSError, ValueError):
                continue  # the sandbox went away meanwhile
    return total // 1024


def page_out(base: Path, count: int, wake: int, data_max_mib: int) -> PageOutRun:
    run = PageOutRun(count)
    data_dir = base / "data-pageout"
    args = ["--pool-size", "1", "--data-pool-size", "0", "--pause-idle", "1"]
    args += ["--max-sessions", str(count + 50), "--max-paused-sessions", str(count + 100)]
    args += ["--idle-timeout", "86400", "--data-max-mib", str(data_max_mib)]
    with serve(base / "state-pageout", data_dir, *args) as api:
        api.server.wait_pooled("lean", 1)
        run.mem_available_before_kib = mem_available_kib()
        run.server_held_before_kib = held_kib(api.server)
        log(f"page-out: making {count} lean sessions (paused 1 s after their last cell)")
        started = time.perf_counter()
        held = create_holding(api, count)
        run.create_s = time.perf_counter() - started
        deadline = time.monotonic() + 600 + count
        while api.metric("cloche_sessions_paused") < count:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"not all {count} sessions were paused; see {api.server.log_path}"
                )
            time.sleep(1.0)  # polling /metrics, with a deadline
        run.all_paused_s = time.perf_counter() - started
        run.mem_available_after_kib = mem_available_kib()
        run.server_held_after_kib = held_kib(api.server)
        run.disk_bytes = disk_bytes(data_dir / "sessions")
        run.data_dir_metric_bytes = int(api.metric("cloche_data_dir_bytes"))
        log(f"page-out: all {count} paused; waking {wake}")
        for session in random.Random(12).sample(sorted(held), min(wake, count)):
            try:
                ms, _ = timed_ms(functools.partial(api.expect, session, "v", held[session]))
            except (RuntimeError, httpx.HTTPError) as exc:
                run.failures.append(f"wake {session}: {exc}")
                continue
            run.wake_ms.append(ms)
    return run


# -- figures, verdicts and tables ----------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    n: int
    p50: float
    p90: float
    min: float
    max: float

    @classmethod
    def of(cls, samples: list[float]) -> Summary:
        if not samples:
            raise ValueError("no samples")
        if len(samples) == 1:
            return cls(1, samples[0], samples[0], samples[0], samples[0])
        p90 = statistics.quantiles(samples, n=10, method="inclusive")[8]
        return cls(len(samples), statistics.median(samples), p90, min(samples), max(samples))


def fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def verdict(measured: float, target: float, unit: str, at_least: bool = False) -> str:
    """met/MISSED with the ratio of measured to target."""
    if math.isnan(measured):
        return "NO SAMPLE: every attempt failed"
    ratio = measured / target
    ok = measured >= target if at_least else measured <= target
    if ok:
        return f"met ({ratio:.2f}x the target)"
    gap = target - measured if at_least else measured - target
    return f"MISSED: {ratio:.2f}x the target ({fmt(gap)} {unit} {'short' if at_least else 'over'})"


def verdicts(
    runs: list[ProfileRun], restarted: RestartRun | None, paged: PageOutRun | None, disk_free: int
) -> list[list[str]]:
    rows: list[list[str]] = []
    by = {run.profile: run for run in runs}

    def p50(profile: str, what: str) -> float:
        samples = by[profile].samples_ms.get(what)
        return Summary.of(samples).p50 if samples else math.nan

    if "lean" in by:
        for what, target in (("pause", 300.0), ("resume on first cell", 400.0)):
            got = p50("lean", what)
            rows.append(
                [f"lean {what} p50 <= {target:.0f} ms", f"{got:.0f} ms", verdict(got, target, "ms")]
            )
        first = p50("lean", "fork of 1: response")
        rows.append(
            ["lean fork, first copy p50 <= 500 ms", f"{first:.0f} ms", verdict(first, 500, "ms")]
        )
        many = p50("lean", f"fork of {FORK_MANY}: response")
        after = (FORK_MANY - 1) / max((many - first) / 1000, 1e-9)
        rows.append(
            [
                "lean fork, >= 5 copies/s after the first",
                f"{after:.1f}/s ({FORK_MANY - 1} more in {many - first:.0f} ms: fork of "
                f"{FORK_MANY} {many:.0f} ms - fork of 1 {first:.0f} ms)",
                verdict(after, 5.0, "copies/s", at_least=True),
            ]
        )
    if "data" in by:
        for what in ("pause", "resume on first cell"):
            got = p50("data", what)
            rows.append(
                [f"data {what} p50 <= 1.5 s", f"{got / 1000:.2f} s", verdict(got, 1500, "ms")]
            )
    if restarted is not None:
        n = restarted.sessions
        back = restarted.stop_s + restarted.all_answered_s
        listening = restarted.stop_s + restarted.listening_s
        rows.append(
            [
                f"restart with 100 live lean sessions back to serving <= 30 s (measured with {n})",
                f"{back:.1f} s SIGTERM -> all {n} answered ({listening:.1f} s to the new "
                "server listening)",
                verdict(back, 30.0, "s"),
            ]
        )
    if paged is not None:
        per_kib = paged.ram_per_session_kib
        disk_per = paged.disk_bytes / paged.sessions
        ram_2000 = 2000 * per_kib * 1024
        disk_2000 = 2000 * disk_per
        own = (paged.server_held_after_kib - paged.server_held_before_kib) / paged.sessions
        measured = (
            f"{paged.sessions} paused: {per_kib / 1024:.2f} MiB RAM each by MemAvailable "
            f"({own / 1024:.2f} MiB by the server's RSS and cgroups), {disk_per / MIB:.1f} MiB "
            f"disk each; 2000 would need {ram_2000 / GIB:.1f} GiB RAM, {disk_2000 / GIB:.1f} GiB "
            f"disk ({disk_free / GIB:.0f} GiB free)"
        )
        fits = ram_2000 <= 20 * GIB and disk_2000 <= disk_free
        how = "measured" if paged.sessions >= 2000 else f"projected from {paged.sessions}"
        rows.append(
            [
                "2000 sessions held on this 24 GiB machine with page-out",
                measured,
                f"{'met' if fits else 'MISSED'} ({how}; RAM {ram_2000 / (20 * GIB):.2f}x of 20 "
                f"GiB usable, disk {disk_2000 / max(disk_free, 1):.2f}x of free)",
            ]
        )
    return rows


def measurement_rows(
    runs: list[ProfileRun], restarted: RestartRun | None, paged: PageOutRun | None
) -> list[list[str]]:
    rows: list[list[str]] = []

    def add(what: str, unit: str, samples: list[float]) -> None:
        if not samples:
            rows.append([what, unit, "0", "-", "-", "-", "-"])
            return
        s = Summary.of(samples)
        p90 = fmt(s.p90) if s.n >= 5 else "-"
        rows.append([what, unit, str(s.n), fmt(s.p50), p90, fmt(s.min), fmt(s.max)])

    for run in runs:
        for what, samples in run.samples_ms.items():
            add(f"{run.profile}: {what}", "ms", samples)
        many = run.samples_ms.get(f"fork of {FORK_MANY}: response", [])
        if many:
            add(
                f"{run.profile}: fork of {FORK_MANY}: copies/s",
                "/s",
                [FORK_MANY * 1000 / ms for ms in many],
            )
        add(
            f"{run.profile}: snapshot size_bytes", "MiB", [b / MIB for b in run.snapshot_size_bytes]
        )
        add(f"{run.profile}: snapshot on disk", "MiB", [b / MIB for b in run.snapshot_disk_bytes])
        add(
            f"{run.profile}: paused session on disk",
            "MiB",
            [b / MIB for b in run.paused_disk_bytes],
        )
    if restarted is not None:
        n = restarted.sessions
        add(f"restart: making {n} sessions (4 at once)", "s", [restarted.create_s])
        add(f"restart: SIGTERM -> exit, pausing {n}", "s", [restarted.stop_s])
        add("restart: the server's own pause time per session", "ms", restarted.shutdown_pause_ms)
        add(
            "restart: a fresh server's start -> listening (for scale)",
            "s",
            [restarted.fresh_listening_s],
        )
        add("restart: new server start -> listening", "s", [restarted.listening_s])
        add(f"restart: new server start -> all {n} answered", "s", [restarted.all_answered_s])
        add(
            f"restart: first cell of each ({ANSWER_WORKERS} at once)", "ms", restarted.first_cell_ms
        )
        add(f"restart: second SIGTERM -> exit, pausing {n} again", "s", [restarted.second_stop_s])
    if paged is not None:
        m = paged.sessions
        add(f"page-out: making {m} sessions (4 at once)", "s", [paged.create_s])
        add(f"page-out: first made -> all {m} paused", "s", [paged.all_paused_s])
        drop = paged.mem_available_before_kib - paged.mem_available_after_kib
        add(f"page-out: MemAvailable drop with {m} paused", "MiB", [drop / 1024])
        add("page-out: MemAvailable drop per paused session", "MiB", [drop / 1024 / m])
        held = paged.server_held_after_kib - paged.server_held_before_kib
        add("page-out: RAM the server holds (RSS + sandbox cgroups), growth", "MiB", [held / 1024])
        add("page-out: ... per paused session", "MiB", [held / 1024 / m])
        add("page-out: disk per paused session", "MiB", [paged.disk_bytes / MIB / m])
        add(
            "page-out: cloche_data_dir_bytes per session",
            "MiB",
            [paged.data_dir_metric_bytes / MIB / m],
        )
        if paged.held_per_gib is not None:
            add("page-out: sessions held per GiB of RAM", "/GiB", [paged.held_per_gib])
        add("page-out: woken session's first cell", "ms", paged.wake_ms)
    return rows


def table(cells: list[list[str]], markdown: bool) -> str:
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]

    def line(row: list[str]) -> str:
        parts = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        return "| " + " | ".join(parts) + " |" if markdown else "  ".join(parts).rstrip()

    rule = (
        "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        if markdown
        else "  ".join("-" * w for w in widths)
    )
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


TARGET_HEADER = ["target", "measured", "verdict"]
ROW_HEADER = ["measurement", "unit", "n", "p50", "p90", "min", "max"]


def render(
    verdict_rows: list[list[str]], rows: list[list[str]], notes: list[str], markdown: bool
) -> str:
    parts = [table([TARGET_HEADER, *verdict_rows], markdown), table([ROW_HEADER, *rows], markdown)]
    return (
        "\n\n".join(parts) + "\n\n" + "\n".join(f"- {n}" if markdown else n for n in notes) + "\n"
    )


# -- main ---------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--lean", type=int, default=10, help="rounds of the lean session (>= 10)")
    parser.add_argument("--data", type=int, default=3, help="rounds of the data session (>= 3)")
    parser.add_argument("--restart", type=int, default=100, help="live sessions at the restart")
    parser.add_argument(
        "--page-out", type=int, default=300, help="idle sessions paged out (2000: the target)"
    )
    parser.add_argument("--wake", type=int, default=20, help="paged-out sessions woken after")
    parser.add_argument(
        "--data-max-mib",
        type=int,
        default=60 * 1024,
        help="--data-dir budget of the page-out server",
    )
    parser.add_argument(
        "--parts",
        default="latency,restart,pageout",
        help="comma-separated subset of latency,restart,pageout",
    )
    parser.add_argument(
        "--resume-at-start",
        choices=("yes", "no"),
        default="yes",
        help="the restarted server's --resume-at-start (no: each session on its first cell)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= {"latency", "restart", "pageout"}:
        parser.error("--parts takes latency, restart and pageout")
    args.parts = parts
    if min(args.lean, args.data, args.restart, args.page_out, args.wake) < 0:
        parser.error("counts can't be negative")
    if "restart" in parts and args.restart < 1 or "pageout" in parts and args.page_out < 1:
        parser.error("--restart and --page-out need at least one session")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if os.geteuid() != 0 or shutil.which("runsc") is None:
        print("bench_durability: needs root and runsc on PATH", file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    foreign: set[str] = set()
    runs: list[ProfileRun] = []
    restarted: RestartRun | None = None
    paged: PageOutRun | None = None
    broken: list[str] = []  # parts that could not finish, and why
    with scratch_dir() as base:
        disk_free = shutil.disk_usage(base).free
        foreign.update(foreign_runsc(base))
        if "latency" in args.parts:
            with part_failing(broken, "latency"):
                runs = latencies(base, args.lean, args.data)
            foreign.update(foreign_runsc(base))
        if "restart" in args.parts:
            with part_failing(broken, "restart"):
                restarted = restart(base, args.restart, args.resume_at_start)
            foreign.update(foreign_runsc(base))
        if "pageout" in args.parts:
            with part_failing(broken, "pageout"):
                paged = page_out(base, args.page_out, args.wake, args.data_max_mib)
            foreign.update(foreign_runsc(base))
        left = leftovers(base)
    if base.exists():
        left.append(f"directory: {base}")
    load_end = os.getloadavg()

    verdict_rows = verdicts(runs, restarted, paged, disk_free)
    rows = measurement_rows(runs, restarted, paged)
    notes = [
        f"Run {started_at}, {os.cpu_count()} cores, MemTotal {mem_total_gib():.1f} GiB, "
        f"{disk_free / GIB:.0f} GiB free on the scratch disk.",
        f"Load average (1/5/15 min) at the start {fmt_load(load_start)}, at the end "
        f"{fmt_load(load_end)}; {len(foreign)} runsc processes of others were seen: the machine "
        f"was {'NOT ' if foreign or load_start[0] > 1.5 else ''}quiet.",
        "All times are a client's, over HTTP (keep-alive) to `cloche serve` as a child process.",
    ]
    if restarted is not None:
        notes.append(
            f"Restart: {restarted.shutdown_pauses} of {restarted.sessions} sessions logged "
            f"`session paused reason=shutdown`; {len(restarted.first_cell_ms)} answered their "
            "first cell with their value."
        )
    if restarted is not None and restarted.failures:
        notes.append(f"Restart: {len(restarted.failures)} failed: " + "; ".join(restarted.failures))
    if paged is not None and paged.failures:
        notes.append(f"Page-out: {len(paged.failures)} failed: " + "; ".join(paged.failures))
    notes += [f"PART NOT FINISHED: {why}" for why in broken]
    for run in runs:
        notes.append(
            f"{run.profile}: {run.rounds_ok} of the rounds ended with the original session "
            f"answering; {len(run.failures)} steps failed"
            + (": " + "; ".join(run.failures) if run.failures else ".")
        )
    print()
    print(render(verdict_rows, rows, notes, markdown=False))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "durability.md").write_text(render(verdict_rows, rows, notes, markdown=True))
    raw = {
        "started_at": started_at,
        "arguments": {
            k: sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
        },
        "machine": {
            "cores": os.cpu_count(),
            "mem_total_gib": mem_total_gib(),
            "kernel": platform.release(),
        },
        "load_average_start": load_start,
        "load_average_end": load_end,
        "foreign_runsc_processes_seen": len(foreign),
        "latency": [asdict(run) for run in runs],
        "restart": asdict(restarted) if restarted is not None else None,
        "page_out": asdict(paged) if paged is not None else None,
        "parts_not_finished": broken,
        "verdicts": [dict(zip(TARGET_HEADER, row, strict=True)) for row in verdict_rows],
    }
    (args.out / "durability.json").write_text(json.dumps(raw, indent=1) + "\n")
    print(f"(written: {args.out / 'durability.json'}, {args.out / 'durability.md'})")
    if left:
        print("\nWARNING: this run left things behind:\n  " + "\n  ".join(left), file=sys.stderr)
        return 1
    print("clean-up: nothing of this run left (no runsc process, mount, cgroup or file)")
    return 0


@contextmanager
def part_failing(broken: list[str], part: str) -> Iterator[None]:
    """A part that fails is reported, and the others still run."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - reported in the results, not hidden
        broken.append(f"{part}: {type(exc).__name__}: {exc}")
        log(f"PART {part} FAILED: {exc}")


def fmt_load(load: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.2f}" for x in load)


def mem_total_gib() -> float:
    match = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    return int(match[1]) / 1024 / 1024 if match else 0.0


if __name__ == "__main__":
    sys.exit(main())
