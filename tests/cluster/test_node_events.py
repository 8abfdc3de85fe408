"""A cluster front end tells its observer (the server's event bus) when a node drains, comes
back into service, or is declared dead. Fake agents stand in for Ray's actors, as in
test_drain_report.py (the real cluster is in test_cluster.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from cloche.cluster.directory import ALIVE, DEAD, DRAINING
from cloche.cluster.manager import ClusterSessionManager
from cloche.cluster.nodes import Node
from cloche.sessions.observer import Observer
from support import make_config

from .test_drain_report import Agent, Call, Directory


class Heard(Observer):
    def __init__(self) -> None:
        self.events: list[tuple[str, str | None, str | None, dict[str, Any]]] = []

    def event(
        self, kind: str, session_id: str | None, owner_key: str | None, data: dict[str, Any]
    ) -> None:
        self.events.append((kind, session_id, owner_key, data))


class Link:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.closed_why: str | None = None

    def close(self, why: str) -> None:
        self.closed_why = why


def make_node(node_id: str) -> Node:
    handle = Agent(held=Call(([], [])))
    return Node(node_id, node_id, "127.0.0.1", 7100, 1, handle, Link(node_id), ALIVE, {})


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
