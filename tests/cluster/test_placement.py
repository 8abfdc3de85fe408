"""Where new sessions go."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cloche.cluster.placement import choose


@dataclass
class FakeNode:
    name: str
    stats: dict[str, Any] = field(default_factory=dict)
    inflight: int = 0


def node(name: str, sessions: int, maximum: int = 100, ready: int = 1) -> FakeNode:
    return FakeNode(
        name,
        {
            "sessions": sessions,
            "max_sessions": maximum,
            "pool": {"lean": ready, "data": 0},
            "memory_available_bytes": 1 << 30,
        },
    )


def test_sessions_spread_evenly_over_equal_nodes() -> None:
    nodes = [node("a", 0), node("b", 0), node("c", 0)]
    for _ in range(60):
        chosen = choose(nodes, "lean")
        assert chosen is not None
        chosen.stats["sessions"] += 1
    assert [n.stats["sessions"] for n in nodes] == [20, 20, 20]


def test_creations_under_way_count_before_the_node_reports_them() -> None:
    nodes = [node("a", 0), node("b", 0)]
    first = choose(nodes, "lean")
    assert first is not None
    first.inflight += 1
    second = choose(nodes, "lean")
    assert second is not None and second is not first


def test_a_fuller_node_gets_fewer_and_a_full_one_none() -> None:
    assert choose([node("a", 50), node("b", 10)], "lean").name == "b"  # type: ignore[union-attr]
    assert choose([node("a", 100), node("b", 100)], "lean") is None
    assert choose([node("a", 10, maximum=10), node("b", 99)], "lean").name == "b"  # type: ignore[union-attr]


def test_a_ready_sandbox_of_the_profile_breaks_a_tie() -> None:
    nodes = [node("a", 5, ready=0), node("b", 5, ready=2)]
    assert choose(nodes, "lean").name == "b"  # type: ignore[union-attr]
    assert choose([], "lean") is None
