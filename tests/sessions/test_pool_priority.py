"""Warming the pool yields the CPU to sessions: a sandbox gets the usual CPU weight only
when a session takes it, and the refill waits a moment after a take."""

from __future__ import annotations

import asyncio
import json

from cgroup_support import cpu_weight, weight
from cloche.sandbox import cgroups
from cloche.sessions import pool


def cpu_shares(instance: str, sandbox_id: str) -> int:
    """A sandbox's CPU weight (v1 cpu.shares, or v2 cpu.weight)."""
    return cpu_weight(cgroups.cgroups_path(instance, sandbox_id))


def test_pooled_sandboxes_wait_with_a_small_cpu_weight_and_sessions_get_the_usual(make_server):
    server = make_server(pool_size=1)
    manager = server.server.manager
    instance = server.server.backend.state.instance
    server.call(manager.pool.wait_full())
    pooled = manager.pool._ready[0]
    assert cpu_shares(instance, pooled.id) == weight(cgroups.STARTING_CPU_SHARES)

    info = server.call(manager.create())
    taken = manager._sessions[info.id].kernel
    assert taken is pooled  # a pool hit
    assert cpu_shares(instance, taken.id) == weight(cgroups.SERVING_CPU_SHARES)
    server.call(manager.close(info.id))


def test_a_sandbox_started_for_a_waiting_session_starts_with_the_usual_weight(make_server):
    server = make_server(pool_size=0)
    manager = server.server.manager
    info = server.call(manager.create())
    kernel = manager._sessions[info.id].kernel
    # It started at full weight (the bundle runsc got says so), not only got it afterwards.
    bundle = json.loads((kernel.sandbox.home / "bundle" / "config.json").read_text())
    assert bundle["linux"]["resources"]["cpu"]["shares"] == cgroups.SERVING_CPU_SHARES
    instance = server.server.backend.state.instance
    assert cpu_shares(instance, kernel.id) == weight(cgroups.SERVING_CPU_SHARES)
    server.call(manager.close(info.id))


def test_the_refill_after_a_take_waits_so_the_new_session_has_the_cpu(make_server):
    server = make_server(pool_size=1)
    manager = server.server.manager
    server.call(manager.pool.wait_full())

    async def take_and_look() -> tuple[str, int, int]:
        info = await manager.create()
        for _ in range(10):  # an immediate refill's task would have woken by now
            await asyncio.sleep(0)
        at_once = manager.pool._starting
        await asyncio.sleep(pool.REFILL_DELAY_S * 2)
        later = manager.pool._starting + manager.pool.ready_count
        return info.id, at_once, later

    session_id, at_once, later = server.call(take_and_look())
    assert at_once == 0, "a sandbox started at once, beside the session just taken"
    assert later == 1, "the refill never began"
    server.call(manager.pool.wait_full())
    server.call(manager.close(session_id))
