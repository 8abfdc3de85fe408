"""Turns across sessions (sessions/gate.py) against a real server: a long cell gives its
turn up and its session runs behind the others (and behind the host's processes) for CPU
until a cell of it is short. What that does to another session's latency (its p99 within
2x of what it is alone, beside sessions flooding output and spinning) is measured by
benchmarks/fairness.py, not asserted here: a timed test fails on a loaded machine."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from cgroup_support import (
    V2,
    behind,
    group_dir,
    sandbox_cpu_s,
    sandbox_ids,
    sandbox_weights,
    weight,
)
from cloche.errors import ProtocolError
from cloche.sandbox import cgroups
from support import (
    NOTHING_LEFT,
    ServerProcess,
    leftovers,
    require_gvisor,
    slowness,
)

pytestmark = [pytest.mark.gvisor, pytest.mark.slow]

# Time scales: a slice of 50 ms, and cells ten times as long, on this project's machines;
# as many times longer as this machine is slower (an emulated CPU: a trivial cell then takes
# more than 50 ms of CPU itself, and would never count as short).
SLOW = slowness()
SLICE = f"{0.05 * SLOW:g}"
# Cells that run long: 0.5 s on this project's machines.
LONG_S = 0.5 * SLOW


def spinning(seconds: float, body: str = "pass") -> str:
    """A cell that runs body in a loop for seconds."""
    return f"import time\nend = time.time() + {seconds:g}\nwhile time.time() < end: {body}"


@pytest.fixture
def state_dir(tmp_path):
    require_gvisor()
    return tmp_path / "state"


def cpu_weights(instance: str) -> list[int]:
    """The CPU weight of each of a server's sandboxes (v1 cpu.shares, or v2 cpu.weight)."""
    return sandbox_weights(instance)


def cpu_used(instance: str, sandbox_id: str) -> float:
    return sandbox_cpu_s(instance, sandbox_id)


def moved(instance: str) -> list[str]:
    return [pid for pids in behind(instance).values() for pid in pids]


def wait_for(condition, timeout_s: float = 60.0 * SLOW) -> None:
    until = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < until, "condition not met in time"
        time.sleep(0.02)  # polling a cgroup file: there is no event to wait on


def test_a_long_cell_gives_its_turn_up_and_runs_behind_the_others(state_dir):
    background = weight(cgroups.BACKGROUND_CPU_SHARES)
    server = ServerProcess(state_dir, "--cell-slots", "1", "--cell-slice", SLICE)
    try:
        with server.client() as c:
            spinner = c.run("0")["session_id"]
            other = c.run("k = 0")["session_id"]
            # A first cell can outrun the 50 ms slice on a busy machine (it is its session's
            # first): a second one, short on the CPU, brings its session level if so.
            for session in (spinner, other):
                assert c.run("pass", session)["status"] == "ok"
        assert background not in cpu_weights(server.instance)
        wait_for(lambda: moved(server.instance) == [])  # moves run in the server's mover thread
        reply: dict[str, object] = {}

        def spin() -> None:
            with server.client() as c:
                reply.update(c.run("while True: pass", spinner))

        thread = threading.Thread(target=spin)
        thread.start()
        # Past its slice, the spinning cell's sandbox (and only it) has the low weight, and
        # its processes are in the top-level behind group for the CPU, and only for it: their
        # memory cgroup (their limits) stays their own...
        wait_for(lambda: cpu_weights(server.instance).count(background) == 1)
        wait_for(lambda: len(behind(server.instance)) == 1 and moved(server.instance) != [])
        (sandbox_id,) = behind(server.instance)
        home = cgroups.cgroups_path(server.instance, sandbox_id)
        for pid in moved(server.instance):
            groups = dict(
                line.split(":", 2)[1:] for line in Path(f"/proc/{pid}/cgroup").read_text().split()
            )
            if V2:  # one group for every controller: the sandbox's limits came along
                assert groups[""] == cgroups.behind_path(server.instance, sandbox_id)
                for name in ("memory.max", "pids.max"):
                    limit = (group_dir(home) / name).read_text()
                    assert (group_dir(groups[""]) / name).read_text() == limit
            else:
                assert groups["memory"] == home
                assert groups["cpu"] == cgroups.behind_path(server.instance, sandbox_id)
        # ...and with the only turn given up, another session's cells still run.
        with server.client() as c:
            for _ in range(20):
                assert c.run("k += 1", other)["status"] == "ok"
            assert c.run("k", other)["output"] == "20\n"
        assert thread.is_alive()
        url = f"http://127.0.0.1:{server.http_port}/v1/sessions/{spinner}/interrupt"
        assert httpx.post(url, timeout=30).json() == {"interrupted": True}
        thread.join(60 * SLOW)
        assert reply["status"] == "error"
        assert "KeyboardInterrupt" in str(reply)
        # An interrupted cell came level with the host's processes, to stop within the
        # grace; its session stays behind the other sandboxes until a cell of it is short
        # (on the CPU: a short cell slowed down by a busy machine counts as short).
        wait_for(lambda: moved(server.instance) == [])
        assert cpu_weights(server.instance).count(background) == 1
        with server.client() as c:
            assert c.run("1 + 1", spinner)["output"] == "2\n"
        assert background not in cpu_weights(server.instance)
        metrics = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics", timeout=30).text
        assert re.search(r"^cloche_cell_slice_overruns_total [1-9]", metrics, re.M), metrics
        assert re.search(r"^cloche_cells_waiting_turn 0\.0$", metrics, re.M), metrics
    finally:
        assert server.stop() == 0
    assert leftovers(state_dir, server.instance) == NOTHING_LEFT


def test_a_long_cell_that_sleeps_stays_among_the_sandboxes(state_dir):
    """Past its slice a sleeping cell is behind the other sandboxes, but not behind the
    host's processes: it would wake behind every pool refill then."""
    background = weight(cgroups.BACKGROUND_CPU_SHARES)
    server = ServerProcess(state_dir, "--cell-slice", SLICE)
    try:
        with server.client() as c:
            sleeper = c.run("import time")["session_id"]
            spinner = c.run("0")["session_id"]
            for session in (sleeper, spinner):  # level, if a first cell outran its slice
                assert c.run("pass", session)["status"] == "ok"
            wait_for(lambda: moved(server.instance) == [])
            assert c.run(f"time.sleep({LONG_S:g})", sleeper)["status"] == "ok"
        assert cpu_weights(server.instance).count(background) == 1
        used_before = {
            sandbox_id: cpu_used(server.instance, sandbox_id)
            for sandbox_id in sandbox_ids(server.instance)
        }

        def spin() -> None:
            with server.client() as c:
                assert c.run("while True: pass", spinner)["status"] == "error"

        thread = threading.Thread(target=spin)
        thread.start()
        # Moves run in order, in one thread: once the spinner's is done (its sandbox is the
        # one using the CPU now), a move of the sleeper's sandbox would be done too.
        wait_for(lambda: cpu_weights(server.instance).count(background) == 2)

        def spinner_moved() -> bool:
            for sandbox_id in behind(server.instance):
                used = cpu_used(server.instance, sandbox_id)
                if used - used_before.get(sandbox_id, used) > 0.2:
                    return True
            return False

        wait_for(spinner_moved)
        assert len(behind(server.instance)) == 1
        url = f"http://127.0.0.1:{server.http_port}/v1/sessions/{spinner}/interrupt"
        assert httpx.post(url, timeout=30).json() == {"interrupted": True}
        thread.join(60 * SLOW)
        assert not thread.is_alive()
    finally:
        assert server.stop() == 0
    assert leftovers(state_dir, server.instance) == NOTHING_LEFT


# A long cell that wants two thirds of a core: four per core leave no time over.
DUTY = (
    "import time\nwhile True:\n    end = time.perf_counter() + 0.006\n"
    "    while time.perf_counter() < end: pass\n    time.sleep(0.003)"
)


def test_a_session_left_behind_by_a_long_cell_comes_level_among_a_crowd(state_dir):
    """A session whose long cell left its sandbox behind the host runs a new long cell
    among more long cells than the cores can serve: it comes level with them, as they all
    do (a crowd stays level). Behind them it would get no CPU at all. Found in the
    egress benchmark, where such sandboxes were looked at as if level, and stayed behind,
    starved, for good: half of fifty downloads got nothing in 5 s."""
    # No pool: a refill, level with the host, would starve the lone spinner below, and bring
    # it level before its cell ends.
    # Cells that outlive the wait below: a cell's end by its time limit would bring it level.
    server = ServerProcess(
        state_dir, "--pool-size", "0", "--cell-slice", SLICE, "--cell-timeout", f"{300 * SLOW:g}"
    )
    crowd = 4 * (os.cpu_count() or 1)
    sessions: list[str] = []
    threads: list[threading.Thread] = []
    try:
        with server.client() as c:
            sessions.append(c.run("0")["session_id"])
            assert c.run("pass", sessions[0])["status"] == "ok"  # level, if "0" ran long
            wait_for(lambda: moved(server.instance) == [])
            # Alone, busy past its slice: behind the host; its cell's end leaves it there.
            assert c.run(spinning(6 * LONG_S), sessions[0])["status"] == "ok"
            left = [sandbox for sandbox, pids in behind(server.instance).items() if pids]
            assert len(left) == 1, "the lone spinner went behind, and stayed"
            for _ in range(crowd):
                sessions.append(c.run("0")["session_id"])
                assert c.run("pass", sessions[-1])["status"] == "ok"
        wait_for(lambda: [s for s, pids in behind(server.instance).items() if pids] == left)

        def run(session: str, code: str) -> None:
            with server.client() as c:
                assert c.run(code, session)["status"] == "error"  # interrupted

        for session in sessions:
            code = "while True: pass" if session == sessions[0] else DUTY
            threads.append(threading.Thread(target=run, args=(session, code)))
            threads[-1].start()
        wait_for(lambda: moved(server.instance) == [])
    finally:
        for session in sessions:
            url = f"http://127.0.0.1:{server.http_port}/v1/sessions/{session}/interrupt"
            httpx.post(url, timeout=30)
        for thread in threads:
            thread.join(60 * SLOW)
        assert server.stop() == 0
    assert not any(thread.is_alive() for thread in threads)
    assert leftovers(state_dir, server.instance) == NOTHING_LEFT


def test_a_server_killed_with_a_sandbox_behind_leaves_nothing_after_the_next_start(state_dir):
    killed = ServerProcess(state_dir)
    with killed.client() as c:
        spinner = c.run("0")["session_id"]
    lost: list[BaseException] = []

    def spin() -> None:
        try:
            with killed.client() as c:
                c.run("while True: pass", spinner)
        except (OSError, ProtocolError) as exc:  # its server is killed under it
            lost.append(exc)

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        wait_for(lambda: moved(killed.instance) != [])
    except BaseException:
        killed.stop()  # not killed after all: it cleans up after itself
        raise
    killed.stop(signal.SIGKILL)
    thread.join(60 * SLOW)
    assert lost, "the spinning cell's client saw its server go"
    successor = ServerProcess(state_dir)
    try:
        assert leftovers(state_dir, killed.instance) == NOTHING_LEFT  # cleaned at start-up
    finally:
        assert successor.stop() == 0
    assert leftovers(state_dir, successor.instance) == NOTHING_LEFT
