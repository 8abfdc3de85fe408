"""A drain reports what moved: a session adopted by another node counts as moved even when
its source went away before releasing it; one whose export failed is failed, with why. Fake
agents stand in for Ray's actors (the real drain is in test_cluster.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cloche.cluster.directory import ALIVE, DRAINING
from cloche.cluster.manager import ClusterSessionManager
from cloche.cluster.members import Node
from cloche.errors import NodeNotFound
from support import make_config


class Call:
    """What `handle.method.remote(...)` and `.options(...).remote(...)` give: an awaitable."""

    def __init__(self, result: Any = None, error: Exception | None = None) -> None:
        self.result, self.error = result, error

    def options(self, **_: Any) -> Call:
        return self

    def remote(self, *args: Any) -> Any:
        async def answer() -> Any:
            if self.error is not None:
                raise self.error
            return self.result

        return answer()


class Split(Call):
    """`.options(num_returns=2).remote(...)`: two object refs, passed on, not awaited."""

    def remote(self, *args: Any) -> Any:
        return self.result


class Agent:
    def __init__(self, **methods: Call) -> None:
        self.__dict__.update(methods)


class Directory:
    def __init__(self) -> None:
        self.placed: dict[str, str] = {}
        self.states: dict[str, str] = {}
        self.place = Call()
        self.set_state = Call()

    def __getattr__(self, name: str) -> Call:
        return Call()


class Link:
    """A live node's data path: a drain only tells it the node answered (over Ray)."""

    def __init__(self) -> None:
        self.heard_times = 0

    def heard(self) -> None:
        self.heard_times += 1


def node(node_id: str, handle: Agent) -> Node:
    stats = {"sessions": 0, "max_sessions": 10, "memory_available_bytes": 1 << 30}
    link: Any = Link()
    return Node(node_id, node_id, "127.0.0.1", 1, 1, handle, link, ALIVE, stats)


async def test_a_move_done_before_its_source_died_counts_as_moved(tmp_path: Path) -> None:
    gone = RuntimeError("the actor died unexpectedly")
    source = Agent(
        held=Call((["s1", "s2"], [])),
        export_session=Split(("raw", "image")),
        release_session=Call(error=gone),  # killed after the target adopted s1 and s2
    )
    target = Agent(adopt_session=Call())
    manager = ClusterSessionManager(make_config(tmp_path, cluster="local:2"))
    manager.engine.directory = Directory()
    manager.nodes = {"a": node("a", source), "b": node("b", target)}
    report = await manager.drain("a")
    assert report["moved"] == 2 and report["failed"] == [] and report["why"] == {}
    assert manager.nodes["a"].state == DRAINING
    # Each answer of the source over Ray (its list, each export) says it lives.
    assert manager.nodes["a"].link.heard_times == 3  # type: ignore[union-attr]
    back = await manager.undrain("a")
    assert back == {"node": "a", "state": ALIVE} and manager.nodes["a"].state == ALIVE


async def test_a_session_that_could_not_be_adopted_is_failed_with_why(tmp_path: Path) -> None:
    source = Agent(
        held=Call((["s1"], [])),
        export_session=Split(("raw", "image")),
        release_session=Call(),
    )
    target = Agent(adopt_session=Call(error=RuntimeError("no room for its image")))
    manager = ClusterSessionManager(make_config(tmp_path, cluster="local:2"))
    manager.engine.directory = Directory()
    manager.nodes = {"a": node("a", source), "b": node("b", target)}
    report = await manager.drain("a")
    assert report["moved"] == 0 and report["failed"] == ["s1"]
    assert report["why"] == {"s1": "no room for its image"}


async def test_a_drain_stops_moving_at_its_grace_and_says_what_stayed(tmp_path: Path) -> None:
    source = Agent(
        held=Call((["s1", "s2"], ["snap"])),
        export_session=Split(("raw", "image")),
        release_session=Call(),
    )
    target = Agent(adopt_session=Call())
    manager = ClusterSessionManager(make_config(tmp_path, cluster="local:2", node_grace_s=0.0))
    manager.engine.directory = Directory()
    manager.nodes = {"a": node("a", source), "b": node("b", target)}
    report = await manager.drain("a")  # the server's --node-grace: 0 here
    assert report["moved"] == 0 and report["failed"] == ["s1", "s2"]
    assert report["why"]["s1"] == "not moved within the drain's grace of 0 s"
    assert report["snapshots"] == 0 and report["snapshots_left"] == 1


async def test_a_node_is_drained_by_its_address_when_it_alone_is_there(tmp_path: Path) -> None:
    source = Agent(
        held=Call((["s1"], [])),
        export_session=Split(("raw", "image")),
        release_session=Call(),
    )
    manager = ClusterSessionManager(make_config(tmp_path, cluster="local:2"))
    manager.engine.directory = Directory()
    there = node("a", source)
    there.host = "10.0.0.7"
    manager.nodes = {"a": there, "b": node("b", Agent(adopt_session=Call()))}
    report = await manager.drain("10.0.0.7", grace_s=30)
    assert report["node"] == "a" and report["moved"] == 1
    manager.nodes["b"].host = "10.0.0.7"
    with pytest.raises(NodeNotFound, match="2 nodes are at 10.0.0.7"):
        await manager.drain("10.0.0.7")
    with pytest.raises(NodeNotFound, match="not found"):
        await manager.drain("10.0.0.9")
