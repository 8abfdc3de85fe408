"""The durability benchmark's three parts, each against a `cloche serve` of its own: the
latencies of one profile's session, a restart with live sessions, and page-out to disk.
"""

from __future__ import annotations

import functools
import os
import random
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

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
