"""An agent whose process got SIGTERM answers "lost" for its sessions, whatever its manager
says as its sandboxes die (the race itself is in test_cluster.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cloche.cluster.agent import NodeAgent
from cloche.errors import SessionLost, SessionNotFound
from support import make_config


async def test_a_leaving_agent_answers_lost_for_what_its_manager_said(tmp_path: Path) -> None:
    agent = NodeAgent(make_config(tmp_path), "node-1", "secret", "127.0.0.1")

    async def _op_execute(on_event: Any, session_id: str) -> Any:
        raise SessionNotFound(session_id)  # what a session that died with its node says

    agent._op_execute = _op_execute  # type: ignore[method-assign]
    with pytest.raises(SessionNotFound):
        await agent._handle("execute", {"session_id": "s1"}, lambda event: None)
    agent.leaving = "its node is shutting down (SIGTERM)"
    with pytest.raises(SessionLost) as lost:
        await agent._handle("execute", {"session_id": "s1"}, lambda event: None)
    assert str(lost.value) == "Session s1 was lost: its node is shutting down (SIGTERM)"
    assert await agent._handle("stats", {}, lambda event: None)  # not about a session: served


def test_sigterm_marks_the_agent_leaving_from_off_the_main_thread() -> None:
    """In a process of its own, as an actor is: the watch is set up on a thread that is not
    the main one, and the handler SIGTERM had before still runs."""
    script = textwrap.dedent(
        """
        import asyncio, os, signal, threading
        from cloche.cluster import agent as module

        chained = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: chained.set())  # Ray's, in a worker

        class Agent:
            node_id, leaving = "node-1", None

        async def main():
            agent = Agent()
            module._watch_sigterm(agent)
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(500):
                if agent.leaving:
                    break
                await asyncio.sleep(0.01)
            print(agent.leaving, flush=True)

        worker = threading.Thread(target=asyncio.run, args=(main(),))
        worker.start()
        while worker.is_alive():
            worker.join(0.01)  # the main thread runs Python handlers between these
        print("chained" if chained.is_set() else "not chained", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["its node is shutting down (SIGTERM)", "chained"]
