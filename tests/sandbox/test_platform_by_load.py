"""With platform "auto", sandboxes started while many already run use ptrace instead of
systrap (systrap's spinning hand-offs cost the most CPU when sandboxes outnumber cores),
against real gVisor."""

from __future__ import annotations

import asyncio
import os

import pytest

from cloche.sandbox import gvisor, runsc
from cloche.sessions.session import SessionInfo


def platform_of(kernel) -> str:
    args = kernel.sandbox.process.args
    return next(a for a in args if a.startswith("--platform=")).removeprefix("--platform=")


def test_few_sandboxes_run_on_the_chosen_platform(make_server):
    server = make_server(pool_size=1)
    runsc = server.server.backend.runsc
    [kernel] = server.server.manager.pool._ready
    assert platform_of(kernel) == runsc.platform


def test_sandboxes_started_beyond_the_threshold_use_ptrace_and_work(make_server, monkeypatch):
    monkeypatch.setattr(gvisor, "PTRACE_FROM_PER_CORE", 0)  # every start is "beyond"
    server = make_server(pool_size=1)
    if server.server.backend.runsc.platform != "systrap":
        pytest.skip("this runsc has no systrap: every sandbox runs on ptrace already")
    manager = server.server.manager
    [kernel] = manager.pool._ready
    assert platform_of(kernel) == "ptrace"
    session_id = server.call(manager.create()).id
    assert server.call(manager.execute(session_id, "6 * 7")).result_text == "42"
    server.call(manager.close(session_id))


def test_a_burst_of_starts_goes_on_ptrace_beyond_the_threshold(make_server, monkeypatch):
    """Sessions asked for all at once, with no pool: each start sees its own count, and the
    ptrace probe made at start-up has its answer, so the starts beyond the threshold use
    ptrace. (Once, every start of a burst read the same count, or went on systrap while
    the first of them probed ptrace: 100 busy systrap sandboxes.)"""
    monkeypatch.setattr(gvisor, "PTRACE_FROM_PER_CORE", 1)
    server = make_server(pool_size=0)
    if server.server.backend.runsc.platform != "systrap":
        pytest.skip("this runsc has no systrap: every sandbox runs on ptrace already")
    manager = server.server.manager
    cores = os.cpu_count() or 1

    async def burst() -> list[SessionInfo]:
        return list(await asyncio.gather(*(manager.create() for _ in range(cores + 3))))

    infos = server.call(burst())
    platforms = [platform_of(manager._sessions[info.id].kernel) for info in infos]
    assert platforms.count("systrap") <= cores, platforms
    assert platforms.count("ptrace") >= 3, platforms
    for info in infos:
        assert server.call(manager.execute(info.id, "6 * 7")).result_text == "42"
        server.call(manager.close(info.id))


def test_a_session_started_on_ptrace_is_restored_on_ptrace(make_server, monkeypatch):
    """A session started on ptrace while many sandboxes ran, paused, comes back with its
    state on ptrace, busy or not: an image is restored on the platform that made it (one
    made on ptrace and restored on systrap wedged about half the time; one made on systrap
    crashes on ptrace), and says so beside runsc's files."""
    monkeypatch.setattr(gvisor, "PTRACE_FROM_PER_CORE", 0)  # every start is "beyond"
    server = make_server(pool_size=0, data_pool_size=0)
    if server.server.backend.runsc.platform != "systrap":
        pytest.skip("this runsc has no systrap: every sandbox runs on ptrace already")
    manager = server.server.manager
    session_id = server.call(manager.create()).id
    assert server.call(manager.execute(session_id, "x = 41")).status.value == "ok"
    assert platform_of(manager._sessions[session_id].kernel) == "ptrace"
    server.call(manager.pause(session_id))
    [made_on] = server.config.data_dir.rglob(runsc.MADE_ON)
    assert made_on.read_text() == "ptrace"
    server.call(manager.resume(session_id))
    kernel = manager._sessions[session_id].kernel
    assert "restore" in kernel.sandbox.process.args and platform_of(kernel) == "ptrace"
    assert server.call(manager.execute(session_id, "x + 1")).result_text == "42"
    server.call(manager.close(session_id))


def test_a_pools_template_is_made_on_the_servers_platform_however_busy(make_server, monkeypatch):
    """The sandbox whose checkpoint a pool restores for each of its clones starts on the
    server's platform even when the host is busy: its clones are restored on the platform
    that made it, and a busy moment at the server's start must not put them all on
    ptrace."""
    monkeypatch.setattr(gvisor, "PTRACE_FROM_PER_CORE", 0)
    server = make_server(pool_size=0, data_pool_size=1)
    if server.server.backend.runsc.platform != "systrap":
        pytest.skip("this runsc has no systrap: every sandbox runs on ptrace already")
    manager = server.server.manager
    session_id = server.call(manager.create(profile="data")).id
    kernel = manager._sessions[session_id].kernel
    assert "restore" in kernel.sandbox.process.args and platform_of(kernel) == "systrap"
    [made_on] = server.server.backend.state.path.rglob(runsc.MADE_ON)
    assert made_on.read_text() == "systrap"
    assert server.call(manager.execute(session_id, "import numpy; 6 * 7")).result_text == "42"
    server.call(manager.close(session_id))
