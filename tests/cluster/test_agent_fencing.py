"""Fencing, without Ray: a node agent the cluster declared dead removes all it held and ends
when it learns so; the directory keeps the verdict; a front end never links a dead node's
agent again and gives its machine a new agent only once the old one fenced itself. Fake
directories and engines stand in for Ray's actors; the agent runs real runsc sandboxes (the
whole story, SIGSTOP and SIGCONT on a local cluster, is in test_fencing.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cloche.cluster import agent as agent_module
from cloche.cluster.agent import NodeAgent
from cloche.cluster.directory import ALIVE, DEAD, DRAINING, Directory
from cloche.cluster.engine import RayNode
from cloche.cluster.link import AgentLink
from cloche.cluster.manager import ClusterSessionManager
from cloche.errors import ClocheError, SessionLost
from support import NOTHING_LEFT, leftovers, make_config, require_gvisor

from .test_drain_report import Call

WAIT_S = 60.0


async def until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} in {timeout_s:g} s"
        await asyncio.sleep(0.02)


# -- the directory ------------------------------------------------------------------------


def test_the_directory_keeps_a_dead_node_dead_and_notes_when_it_fenced() -> None:
    directory = Directory()
    assert directory.node_state("n1") is None  # not joined yet
    assert directory.join({"id": "n1", "ray_id": "r1", "pid": 1}) == ALIVE
    directory.fenced("n1")  # only a dead node fences
    assert "fenced" not in directory.nodes["n1"]
    directory.set_state("n1", DRAINING)
    assert directory.node_state("n1") == DRAINING
    directory.set_state("n1", DEAD)
    directory.set_state("n1", ALIVE)  # dead is for good
    assert directory.node_state("n1") == DEAD
    # Its agent, asked to start again by a front end that has not heard, says its old id.
    assert directory.join({"id": "n1", "ray_id": "r1", "pid": 1}) == DEAD
    directory.fenced("n1")
    assert directory.nodes["n1"]["fenced"] is True and directory.node_state("n1") == DEAD
    assert directory.join({"id": "n1", "ray_id": "r1", "pid": 1}) == DEAD
    assert directory.nodes["n1"]["fenced"] is True  # a late join keeps the note
    assert directory.join({"id": "n2", "ray_id": "r1", "pid": 2}) == ALIVE  # its successor


# -- a front end ----------------------------------------------------------------------------


class Recorded(Call):
    """A Ray method that records what it was asked."""

    def __init__(self, result: Any = None) -> None:
        super().__init__(result)
        self.asked: list[tuple[Any, ...]] = []

    def remote(self, *args: Any) -> Any:
        self.asked.append(args)
        return super().remote(*args)


class Handle:
    def __init__(self, described: dict[str, Any]) -> None:
        self.start = Recorded(described)
        self.held = Recorded(([], []))


class FakeDirectory:
    def __init__(self, nodes: list[dict[str, Any]], join_says: str = ALIVE) -> None:
        self.all_nodes = Call(nodes)
        self.size = Call({"sessions": 0, "snapshots": 0})
        self.join = Recorded(join_says)
        self.place = Recorded()

    def __getattr__(self, name: str) -> Call:
        return Call()


def front_end(tmp_path: Path, directory: FakeDirectory) -> ClusterSessionManager:
    manager = ClusterSessionManager(make_config(tmp_path, cluster="local:2"))
    manager.engine.directory = directory
    return manager


def entry(node_id: str, ray_id: str, state: str, **more: Any) -> dict[str, Any]:
    return {"id": node_id, "ray_id": ray_id, "host": "127.0.0.1", "port": 1, "pid": 1,
            "state": state, **more}  # fmt: skip


async def test_a_machine_gets_a_new_agent_only_once_its_dead_one_fenced_itself(
    tmp_path: Path,
) -> None:
    directory = FakeDirectory(
        [
            entry("a1", "ray-a", DEAD),  # declared dead; may still hold sandboxes (frozen)
            entry("b1", "ray-b", DEAD, fenced=True),  # declared dead, then fenced itself
            entry("c1", "ray-c", DEAD, fenced=True),
            entry("c2", "ray-c", DEAD),  # its successor, dead again and not fenced yet
            entry("d1", "ray-d", ALIVE),  # another front end's: linked here too
        ]
    )
    manager = front_end(tmp_path, directory)
    machines = [RayNode(f"ray-{x}", "127.0.0.1", i) for i, x in enumerate("abcde")]
    manager.engine.nodes = lambda: machines  # type: ignore[method-assign]
    ended: set[str] = set()  # the ray ids whose agents Ray says died
    manager.engine.agent_ended = lambda ray_id, *_: ray_id in ended  # type: ignore[method-assign]
    joined: list[tuple[str, int | None]] = []

    async def join(ray_node: RayNode, predecessor: int | None = None) -> None:
        joined.append((ray_node.ray_id, predecessor))

    manager._join = join  # type: ignore[method-assign]
    await manager._discover()
    # A successor cleans what its dead predecessor (by its pid) left; a first agent, not.
    assert sorted(joined) == [("ray-b", 1), ("ray-d", None), ("ray-e", None)]
    # a1's agent was killed -9: Ray says its actor died; its machine gets a new agent.
    ended.add("ray-a")
    joined.clear()
    await manager._discover()
    assert ("ray-a", 1) in joined and not any(ray_id == "ray-c" for ray_id, _ in joined)
    # Every dead node shows in GET /v1/cluster, under its old id, as dead.
    assert {n.id: n.state for n in manager.nodes.values()} == {
        "a1": DEAD,
        "b1": DEAD,
        "c1": DEAD,
        "c2": DEAD,
    }


async def test_a_front_end_never_links_an_agent_the_directory_has_dead(tmp_path: Path) -> None:
    directory = FakeDirectory([], join_says=DEAD)
    manager = front_end(tmp_path, directory)
    # The fenced agent, not gone yet, answers a front end's start with its old id.
    stale = Handle({"id": "a1", "host": "127.0.0.1", "port": 1, "pid": 1})
    manager.engine.agent = lambda *_: stale  # type: ignore[method-assign]
    await manager._join(RayNode("ray-a", "127.0.0.1", 0))
    assert manager.nodes == {}
    assert stale.held.asked == [] and directory.place.asked == []  # its sessions stay lost
    assert [args[0]["id"] for args in directory.join.asked] == ["a1"]


# -- the agent ------------------------------------------------------------------------------


class FakeMembership:
    """The directory's word on the node, as a test decides it."""

    def __init__(self) -> None:
        self.verdict: str | None = ALIVE
        self.unreachable = True  # the first ask fails, as when Ray's control plane is busy
        self.asked = 0
        self.fenced_ids: list[str] = []
        self.exits = 0

    async def state(self, node_id: str) -> str | None:
        self.asked += 1
        if self.unreachable:
            self.unreachable = False
            raise ConnectionError("the directory did not answer")
        return self.verdict

    async def fenced(self, node_id: str) -> None:
        self.fenced_ids.append(node_id)

    def exit(self) -> None:
        self.exits += 1


def noop(event: dict[str, Any]) -> None:
    pass


@pytest.mark.gvisor
async def test_an_agent_declared_dead_removes_all_it_held_and_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_gvisor()
    monkeypatch.setattr(agent_module, "MEMBERSHIP_CHECK_S", 0.05)
    config = make_config(tmp_path / "state", pool_size=1)
    membership = FakeMembership()
    agent = NodeAgent(config, "node-1", "secret", "127.0.0.1", membership=membership)
    await agent.start()
    instance = agent.manager.backend.state.instance
    try:

        async def ask(op: str, **args: Any) -> Any:
            return await agent._handle(op, args, noop)

        async def run(session_id: str, code: str) -> Any:
            return await ask(
                "execute", session_id=session_id, code=code, owner=None, timeout_s=None,
                track_files=False, silent=False, stream=False,
            )  # fmt: skip

        made = [
            (await ask("create", owner=None, profile="lean", snapshot=None))["info"]["id"]
            for _ in range(2)
        ]
        live, paused = made
        assert (await run(live, "x = 41; x + 1"))["result"]["json"] == 42
        snapshot = (await ask("snapshot", session_id=live, owner=None, name="kept"))["id"]
        await ask("pause", session_id=paused, owner=None)
        homes = [
            config.data_dir / "sessions" / paused,
            config.data_dir / "snapshots" / snapshot,
        ]
        assert all(home.is_dir() for home in homes)
        assert leftovers(config.state_dir, instance)["processes"] != []  # its sandboxes
        downs: list[str] = []
        link = AgentLink(
            "node-1", "127.0.0.1", agent.port, "secret",
            lambda _, why: downs.append(why), lambda *_: None,
        )  # fmt: skip
        await link.connect()

        # Alive (after one ask the directory did not answer): nothing happens.
        await until(lambda: membership.asked >= 3, "asks of the directory")
        assert agent.fenced is None and membership.fenced_ids == []
        assert (await run(live, "x"))["result"]["json"] == 41

        membership.verdict = DEAD
        await until(lambda: membership.exits == 1, "the fenced agent's exit")
        assert membership.fenced_ids == ["node-1"]
        assert agent.manager.session_ids() == [] and agent.manager.snapshot_ids() == []
        assert [home for home in homes if home.exists()] == []
        assert list((config.data_dir / "sessions").iterdir()) == []
        assert leftovers(config.state_dir, instance) == NOTHING_LEFT  # no runsc, mount, cgroup
        await until(lambda: downs != [], "the front end's link to go down")
        for session_id in made:  # asked now (a front end that had not heard): lost, with why
            with pytest.raises(SessionLost) as lost:
                await run(session_id, "x")
            assert str(lost.value) == f"Session {session_id} was lost: its node failed"
        with pytest.raises(ClocheError, match="declared dead"):
            await ask("create", owner=None, profile="lean", snapshot=None)
        with pytest.raises(ClocheError, match="declared dead"):
            await agent.adopt_session({}, b"")
        assert membership.exits == 1
    finally:
        await agent.stop()  # nothing to do once fenced; a failed test's sandboxes go
    assert leftovers(config.state_dir, instance) == NOTHING_LEFT
