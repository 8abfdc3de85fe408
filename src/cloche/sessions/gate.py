"""Cells of all sessions admitted in turn: at most a few run at once, each for one slice.

Left to the host's scheduler, many busy sandboxes are served unevenly: measured with 100
sessions each looping `i += 1`, some ran 20 times as many cells as others in the same
seconds, and the slow ones' p99 was hundreds of ms. The gate hands out `slots` places in
arrival order (asyncio's semaphore wakes its waiters first come, first served), so every
busy session gets its turn in the order it asked: round-robin over the sessions with a
cell waiting, as each session sends one cell at a time.

A cell holds its place for one slice at most. One that runs longer (a computation, a
sleep, a wait for an LLM) gives it up and goes on without one, so long cells never block
short ones; the `overran` callback lets the caller lower such a cell's CPU weight, so
that it takes what the short cells leave.

The gate also knows the crowd: sessions whose long cells were seen using the CPU, or
behind the host's processes (`note_long`). More of them than cores (fifty downloads) are
`crowded`: then none of them is put behind the host's processes, where sandboxes get only
the CPU left over, unevenly (sessions/cpu.py `cpu_move`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

# The default number of places: measured with 10-100 busy sessions on 2 cores, 3-4 per core
# kept the p99 of 100 sessions near 150 ms (555 ms without the gate) and lost the least
# throughput; 6 per core let the unevenness back in (benchmarks/results/throughput.md).
SLOTS_PER_CORE = 4


class CellGate:
    """Places for running cells, taken in arrival order and held for one slice at most."""

    def __init__(self, slots: int, slice_s: float) -> None:
        if slots < 1 or slice_s <= 0:
            raise ValueError("a cell gate needs at least one slot and a positive slice")
        self.slots = slots
        self.slice_s = slice_s
        self._free = asyncio.Semaphore(slots)
        self.waiting = 0  # cells waiting for a place now
        self.overruns = 0  # cells that outran their slice
        self.cores = os.cpu_count() or 1
        self._long: set[str] = set()  # sessions whose long cell was busy at its last look

    def note_long(self, session_id: str, busy: bool) -> None:
        """Whether a session's cell past its slice used the CPU (or was behind the host) when
        last looked at; False once it ends."""
        if busy:
            self._long.add(session_id)
        else:
            self._long.discard(session_id)

    @property
    def crowded(self) -> bool:
        """More long cells busy (or behind the host) than cores."""
        return len(self._long) > self.cores

    def admitted(self, overran: Callable[[], None] | None = None) -> Place:
        """A place (`async with`): wait for one, hold it while the block runs or for one
        slice, whichever is shorter; when the slice ends first, `overran` is called (once)."""
        return Place(self, overran)


class Place:
    """One cell's place at the gate (a class, not a generator: it is taken on every cell)."""

    __slots__ = ("gate", "held", "overran", "timer")

    def __init__(self, gate: CellGate, overran: Callable[[], None] | None) -> None:
        self.gate = gate
        self.overran = overran
        self.held = False
        self.timer: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> None:
        gate = self.gate
        gate.waiting += 1
        try:
            await gate._free.acquire()
        finally:
            gate.waiting -= 1
        self.held = True
        self.timer = asyncio.get_running_loop().call_later(gate.slice_s, self._give_up)

    def _give_up(self) -> None:
        if self.held:
            self.held = False
            self.gate._free.release()
            self.gate.overruns += 1
            if self.overran is not None:
                self.overran()

    async def __aexit__(self, *_: object) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.held:
            self.held = False
            self.gate._free.release()
