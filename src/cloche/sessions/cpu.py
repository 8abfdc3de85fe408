"""Where a session's sandbox stands for the CPU while its cells take turns at the gate.

A cell that outruns its slice at the gate (`sessions.gate`) puts its sandbox behind the
other sandboxes for the CPU (a lower weight), and behind the host's processes too once it
is seen busy; starved there, or in a crowd of long cells, it comes level again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from cloche.sessions.gate import CellGate
from cloche.sessions.kernel import KernelClient
from cloche.sessions.result import CellResult

# A cell past its slice is looked at this much later, and then at twice the interval each
# time, up to BUSY_LOOK_MAX_S, while it runs: once its sandbox used at least half of an
# interval on the CPU, it is put behind the host's processes as well (see
# Sandbox.background). A cell that sleeps or waits (for an LLM, or a one-shot request's
# `time.sleep`) is not: waking behind them, it would wait for every pool refill to end.
BUSY_LOOK_S = 0.02
# At most: a sandbox starved behind the host waits this long to come level (with 1 s, the
# slowest of fifty downloads got 2-3x less than the fastest; with 0.25 s, 1.3-1.5x). Fifty
# long cells cost ~200 looks a second, two reads of cgroup files each.
BUSY_LOOK_MAX_S = 0.25
# Behind the host, a sandbox gets the CPU only when nothing else wants it. Other sandboxes
# whose cells run long but were never busy enough to go there (fifty downloads on two
# cores: a twenty-fifth of a core each) would starve it for good: one that gets less than
# STARVED_SHARE of a core while the sandboxes level with the host use at least half of one
# comes level again (one of fifty downloading sessions got 0.2 MiB/s, another 32).
BUSY_SHARE_OF_LOOK = 0.5
STARVED_SHARE = 0.125
# A long cell whose sandbox used this share of a core, or is behind the host (starved there,
# it could not show it wants more), counts in the crowd (CellGate.crowded): more such cells
# than cores all stay level with the host. Behind it, sandboxes share what the host leaves
# unevenly (and each move behind and back costs the mover a cgroup migration): of fifty
# sessions downloading at once, half got no byte in 5 s while one got 900 MiB; level, the
# slowest got 1.1-1.8x less than the fastest (BENCHMARKS.md, egress).
CROWD_SHARE = 0.02
BEHIND, LEVEL, STAY = "behind", "level", "stay"


def cpu_move(moved: bool, share: float, peers_share: float | None, crowded: bool = False) -> str:
    """Where a sandbox whose cell runs long goes for the CPU after a look: BEHIND the host's
    processes (busy: `share` of a core is at least half), LEVEL with them again (behind,
    and starved by other sandboxes level with the host: `peers_share` is their summed
    share, None when not counted; or `crowded`: more long cells busy than cores), or STAY
    where it is."""
    if crowded:
        return LEVEL if moved else STAY
    if not moved:
        return BEHIND if share >= BUSY_SHARE_OF_LOOK else STAY
    if share < STARVED_SHARE and peers_share is not None and peers_share >= BUSY_SHARE_OF_LOOK:
        return LEVEL
    return STAY


class CpuPlacement:
    """Where one session's sandbox stands for the CPU, across its cells.

    Args:
        session_id: the session's, as the gate counts the crowd by.
        gate: the cell gate of the session's manager.
        kernel_now: the session's kernel at the moment asked (None once it is closed).
    """

    def __init__(
        self,
        session_id: str,
        gate: CellGate,
        kernel_now: Callable[[], KernelClient | None],
    ) -> None:
        self.session_id = session_id
        self.gate = gate
        self._kernel_now = kernel_now
        self.behind = False  # its sandbox runs behind the others: its cells run long
        self._look: asyncio.TimerHandle | None = None  # at the CPU use of a cell running long

    async def take_turn(
        self,
        kernel: KernelClient,
        run: Callable[[], Awaitable[CellResult]],
    ) -> CellResult:
        """Run the cell in its turn at the gate; its wait is in the result's queue_wait_s.

        A cell that outruns its slice puts its sandbox behind the others for CPU, and the
        session stays behind while its cells keep running long (a loop of long cells would
        otherwise take the CPU at full weight for the first slice of each). Its first cell
        that uses less CPU than a slice brings it level again: CPU, not time, as a short
        cell slowed down behind the others would otherwise keep it there for good.
        """
        overran = False
        cpu_before = kernel.sandbox.cpu_seconds() if self.behind else None

        def go_behind() -> None:
            nonlocal overran
            overran = True
            if not self.behind:
                self.behind = True
                kernel.sandbox.background(True)
            # Behind the host already when a long cell before this one left it there.
            moved = kernel.sandbox.behind_the_host
            self._look_at_cpu(kernel, None, None, BUSY_LOOK_S, moved)

        asked = time.perf_counter()
        try:
            async with self.gate.admitted(go_behind):
                waited_s = time.perf_counter() - asked
                result = await run()
        finally:
            self.gate.note_long(self.session_id, False)
            if self._look is not None:
                self._look.cancel()
                self._look = None
            if self.behind and self._was_short(overran, cpu_before):
                self.behind = False
                if kernel.alive:
                    kernel.sandbox.background(False)
        result.queue_wait_s = waited_s
        return result

    def _look_at_cpu(
        self,
        kernel: KernelClient,
        used_before: float | None,
        peers_before: float | None,
        interval_s: float,
        moved: bool = False,
    ) -> None:
        """While a cell past its slice runs: once its sandbox used at least half of the
        interval since the last look on the CPU, put it behind the host's processes too;
        else look again, after twice the interval (up to BUSY_LOOK_MAX_S). Once behind, look
        on each BUSY_LOOK_MAX_S: starved there by other sandboxes (see `cpu_move`), it comes
        level with the host again (still at its low weight among the sandboxes)."""
        self._look = None
        sandbox = kernel.sandbox
        used = sandbox.cpu_seconds()
        peers = sandbox.peers_cpu_seconds()
        if used is None or not self.behind or kernel.stopping:
            return  # a cell told to stop stays level with the host (KernelClient._signal)
        if used_before is not None:
            share = (used - used_before) / interval_s
            # Behind, it may be starved: it counts as busy (else it could not show it is).
            self.gate.note_long(self.session_id, moved or share >= CROWD_SHARE)
            peers_share = None if peers is None or peers_before is None else (peers - peers_before)
            move = cpu_move(
                moved,
                share,
                None if peers_share is None else peers_share / interval_s,
                self.gate.crowded,
            )
            if move == BEHIND:
                sandbox.background(True, busy=True)
                moved = True
            elif move == LEVEL:
                sandbox.level_with_the_host()
                moved = False
            interval_s = BUSY_LOOK_MAX_S if moved else min(interval_s * 2, BUSY_LOOK_MAX_S)
        self._look = asyncio.get_running_loop().call_later(
            interval_s, self._look_at_cpu, kernel, used, peers, interval_s, moved
        )

    def _was_short(self, overran: bool, cpu_before: float | None) -> bool:
        """Whether the cell just run was short: on the CPU, when it started behind and the
        sandbox's CPU is counted; else in time (within its slice)."""
        kernel = self._kernel_now()
        cpu_after = kernel.sandbox.cpu_seconds() if kernel is not None else None
        if cpu_before is None or cpu_after is None:
            return not overran
        return cpu_after - cpu_before < self.gate.slice_s
