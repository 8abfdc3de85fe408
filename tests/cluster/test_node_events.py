"""A cluster front end tells its observer (the server's event bus) when a node drains, comes
back into service, or is declared dead. Fake agents stand in for Ray's actors, as in
test_drain_report.py (the real cluster is in test_cluster.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from cloche.cluster.directory import ALIVE, DEAD, DRAINING
from cloche.cluster.directory import Directory as RealDirectory
from cloche.cluster.manager import ClusterSessionManager
from cloche.cluster.members import Node
from cloche.sessions.observer import Observer
from support import make_config

from .test_drain_report import Agent, Call, Directory


class Heard(Observer):
    def __init__(self) -> None:
        self.events: list[tuple[str, str | None, str | None, dict[str, Any]]] = []
        self.webhooks: list[frozenset[str] | None] = []  # the receivers each is delivered to

    def event(
        self,
        kind: str,
        session_id: str | None,
        owner_key: str | None,
        data: dict[str, Any],
        webhooks: frozenset[str] | None = None,
    ) -> None:
        self.events.append((kind, session_id, owner_key, data))
        self.webhooks.append(webhooks)


class Link:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.closed_why: str | None = None

    def heard(self) -> None:
        pass

    def close(self, why: str) -> None:
        self.closed_why = why


def make_node(node_id: str) -> Node:
    handle = Agent(held=Call(([], [])))
    return Node(node_id, node_id, "127.0.0.1", 7100, 1, handle, Link(node_id), ALIVE, {})


async def test_a_node_declared_dead_is_logged_loudly_with_what_to_raise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = ClusterSessionManager(make_config(tmp_path, cluster="local:2", node_deadline_s=30))
    manager.engine.directory = Directory()
    manager.nodes = {"a": make_node("a")}
    manager.nodes["a"].residents = {"s1": "k1", "s2": "k2"}
    with caplog.at_level(logging.ERROR, logger="cloche.cluster"):
        manager._link_down(manager.nodes["a"].link, "no answer for 30.4 s")  # type: ignore[arg-type]
        await asyncio.gather(*manager._background)
    (record,) = [r for r in caplog.records if "DECLARED DEAD" in r.getMessage()]
    assert record.levelno == logging.ERROR
    assert record.getMessage() == (
        "NODE DECLARED DEAD: node a (127.0.0.1:7100, agent pid 1, alive) is dead for good: "
        "no answer for 30.4 s; its 2 sessions are told lost, its agent fences itself if it "
        "comes back. If its machine was only slow (starved of CPU), raise --node-deadline (30 s)"
    )


async def test_a_drain_a_return_and_a_death_are_told_as_node_events(tmp_path: Path) -> None:
    heard = Heard()
    manager = ClusterSessionManager(make_config(tmp_path, cluster="local:2"), heard)
    manager.engine.directory = Directory()
    manager.nodes = {"a": make_node("a"), "b": make_node("b")}
    await manager.drain("a")
    await manager.undrain("a")
    await manager.undrain("a")  # already in service: nothing new to tell
    manager._link_down(manager.nodes["b"].link, "no heartbeat for 5 s")
    await asyncio.gather(*manager._background)
    assert [(kind, data["node"], data["state"]) for kind, _, _, data in heard.events] == [
        ("node.draining", "a", DRAINING),
        ("node.up", "a", ALIVE),
        ("node.dead", "b", DEAD),
    ]
    assert all(session is None and owner is None for _, session, owner, _ in heard.events)
    assert heard.events[0][3]["address"] == "127.0.0.1:7100"
    assert heard.events[-1][3]["why"] == "no heartbeat for 5 s"


class Remote:
    """A real directory reached as through Ray: `directory.method.remote(...)` awaitable."""

    def __init__(self, directory: RealDirectory) -> None:
        self._directory = directory

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._directory, name)

        class Method:
            @staticmethod
            def remote(*args: Any) -> Any:
                async def answer() -> Any:
                    return method(*args)

                return answer()

        return Method


async def test_front_ends_share_out_a_node_s_events_so_each_webhook_gets_each_once(
    tmp_path: Path,
) -> None:
    """Two front ends tell the same changes of the nodes (one drains, the other learns it
    from the directory; both see a node die): both tell each on their streams, and a
    receiver both have gets each from one of them; each front end's own, from it."""
    directory = RealDirectory()
    front_ends = []
    for i in range(2):
        heard = Heard()
        config = make_config(tmp_path / f"front-end-{i}", cluster="local:2")
        manager = ClusterSessionManager(config, heard, webhooks=frozenset({"hook", f"own-{i}"}))
        manager.engine.directory = Remote(directory)
        manager.nodes = {"a": make_node("a"), "b": make_node("b")}
        manager.nodes["b"].residents = {"s1": "k1"}  # lost with b
        front_ends.append((manager, heard))
    for node_id in ("a", "b"):
        directory.join({"id": node_id, "ray_id": node_id, "pid": 1})
    for manager, _ in front_ends:  # each links both nodes (their first turn)
        for node in manager.nodes.values():
            await manager._announce(node, ALIVE, turn=0)
    (first, _), (second, _) = front_ends

    def learnt(manager: ClusterSessionManager) -> None:  # what _discover does
        entry = directory.nodes["a"]
        manager._set_state(manager.nodes["a"], entry["state"], tell=False, turn=entry["turn"])

    await first.drain("a")
    learnt(second)
    await first.undrain("a")
    learnt(second)
    await first.drain("a")  # a second drain: told again, a turn of its own
    learnt(second)
    for manager, _ in front_ends:
        manager._link_down(manager.nodes["b"].link, "no heartbeat")
        await asyncio.gather(*manager._background)

    told = [
        [(kind, session or data["node"]) for kind, session, _, data in heard.events]
        for _, heard in front_ends
    ]
    assert (
        told[0]
        == told[1]
        == [
            ("node.up", "a"),
            ("node.up", "b"),
            ("node.draining", "a"),
            ("node.up", "a"),
            ("node.draining", "a"),
            ("node.dead", "b"),
            ("session.closed", "s1"),
        ]
    )
    for n in range(len(told[0])):
        given = [heard.webhooks[n] or frozenset() for _, heard in front_ends]
        assert ["hook" in g for g in given].count(True) == 1, told[0][n]
        assert [f"own-{i}" in g for i, g in enumerate(given)] == [True, True], told[0][n]
