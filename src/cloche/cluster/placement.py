"""Where a new session goes: the live node with the most headroom."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar


class Candidate(Protocol):
    """A node as placement sees it: its agent's last figures, and creations under way."""

    stats: dict[str, Any]  # sessions, max_sessions, pool {profile: ready}, memory_available_bytes
    inflight: int


N = TypeVar("N", bound=Candidate)


def headroom(node: Candidate, profile: str) -> tuple[float, bool, int]:
    """Free share of --max-sessions first (spreads sessions evenly over equal nodes), then a
    ready pool sandbox of the profile (no start to wait for), then free memory."""
    stats = node.stats
    held = stats.get("sessions", 0) + node.inflight
    maximum = max(1, stats.get("max_sessions", 1))
    ready = stats.get("pool", {}).get(profile, 0) > node.inflight
    return 1 - held / maximum, ready, stats.get("memory_available_bytes", 0)


def choose(nodes: Sequence[N], profile: str) -> N | None:
    """The node for a new session of a profile, or None when every node is full."""
    room = [
        n for n in nodes if n.stats.get("sessions", 0) + n.inflight < n.stats.get("max_sessions", 1)
    ]
    if not room:
        return None
    return max(room, key=lambda n: headroom(n, profile))
