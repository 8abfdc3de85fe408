"""Where a sandbox whose cell runs long goes for the CPU after each look (`cpu_move`)."""

from __future__ import annotations

import pytest

from cloche.sessions.cpu import BEHIND, LEVEL, STAY, cpu_move


@pytest.mark.parametrize(
    ("moved", "share", "peers", "expected"),
    [
        (False, 0.9, None, BEHIND),  # busy on the CPU: behind the host's processes
        (False, 0.5, 1.5, BEHIND),
        (False, 0.04, 1.9, STAY),  # one of fifty downloads: among the sandboxes
        (False, 0.0, None, STAY),  # a cell that sleeps or waits
        (True, 0.9, 0.0, STAY),  # behind, and still getting the CPU: a hog stays there
        (True, 0.02, 0.1, STAY),  # behind, the host's own processes take the CPU: stays
        (True, 0.02, None, STAY),  # the others' use is not counted: no guess
        (True, 0.02, 1.8, LEVEL),  # starved by sandboxes level with the host: back level
        (True, 0.2, 1.8, STAY),  # a fair share while they run: stays
    ],
)
def test_moves(moved: bool, share: float, peers: float | None, expected: str) -> None:
    assert cpu_move(moved, share, peers) == expected


@pytest.mark.parametrize(
    ("moved", "share", "peers", "expected"),
    [
        (False, 0.9, 1.9, STAY),  # busy, but one of a crowd: level with the others
        (False, 0.04, 1.9, STAY),
        (True, 0.9, 0.0, LEVEL),  # behind: back level, where the crowd shares evenly
        (True, 0.02, None, LEVEL),
    ],
)
def test_a_crowd_stays_level(moved: bool, share: float, peers: float | None, expected: str) -> None:
    assert cpu_move(moved, share, peers, crowded=True) == expected
