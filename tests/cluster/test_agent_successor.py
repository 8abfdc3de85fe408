"""A node agent started on a machine whose agent was declared dead (its successor), without
Ray: the predecessor, a real agent in a process of its own with real runsc sandboxes, ends
abruptly as Ray ends a worker (nothing of its own stop runs) but slowly, still holding its
state directory as the successor starts (as a Ray worker given SIGTERM does while it
finalizes). The successor waits for that process to end, then cleans what it left: no
mount, runsc, cgroup or state of it remains (the whole story on a local cluster is in
test_agent_sigterm.py)."""

from __future__ import annotations

import asyncio
import logging
import pickle
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cloche.cluster.agent import NodeAgent
from support import NOTHING_LEFT, leftovers, make_config, require_gvisor

pytestmark = [pytest.mark.gvisor, pytest.mark.timeout(600)]

WAIT_S = 120.0

PREDECESSOR = textwrap.dedent(
    """
    import asyncio, os, pickle, sys
    from cloche.cluster.agent import NodeAgent

    async def main():
        with open(sys.argv[1], "rb") as kept:
            config = pickle.load(kept)
        agent = NodeAgent(config, "node-1", "secret", "127.0.0.1")
        await agent.start()
        print(agent.manager.backend.state.instance, flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # its end, when the test says
        os._exit(0)  # abruptly: no stop of its own, as Ray ends a worker

    asyncio.run(main())
    """
)


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} in {WAIT_S:g} s"
        await asyncio.sleep(0.02)


async def test_a_successor_waits_for_its_ending_predecessor_then_cleans_what_it_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    require_gvisor()
    config = make_config(tmp_path / "state", pool_size=1)
    kept = tmp_path / "config.pickle"
    kept.write_bytes(pickle.dumps(config))
    predecessor = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PREDECESSOR, str(kept),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    successor: NodeAgent | None = None
    try:
        assert predecessor.stdout is not None and predecessor.stdin is not None
        instance = (await asyncio.wait_for(predecessor.stdout.readline(), WAIT_S)).decode()
        instance = instance.strip()
        assert instance, "the predecessor did not start"
        assert leftovers(config.state_dir, instance)["mounts"] != []  # its pool's sandbox

        successor = NodeAgent(config, "node-2", "secret", "127.0.0.1", predecessor=predecessor.pid)
        with caplog.at_level(logging.INFO, logger="cloche.cluster"):
            starting = asyncio.create_task(successor.start())
            await until(
                lambda: starting.done() or f"pid {predecessor.pid}" in caplog.text,
                "the successor's start, or its wait for its predecessor",
            )
        predecessor.stdin.write(b"end\n")  # it ends now (without its fix: after the start)
        await predecessor.stdin.drain()
        await asyncio.wait_for(starting, WAIT_S)
        assert await asyncio.wait_for(predecessor.wait(), WAIT_S) == 0
        assert leftovers(config.state_dir, instance) == NOTHING_LEFT
        assert successor.manager.session_ids() == []
        pool = successor.manager.pools["lean"]
        await until(lambda: pool.ready_count == 1, "the successor's pool")  # it serves
    finally:
        if predecessor.returncode is None:  # a failed test's: this test's own child
            predecessor.kill()
            await asyncio.wait_for(predecessor.wait(), WAIT_S)
        if successor is not None:
            await successor.stop()
        # What a failed test's predecessor left (a restarted server's sweep).
        from cloche.sandbox.registry import create_backend

        create_backend(config).sweep()
