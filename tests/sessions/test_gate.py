"""The cell gate on its own: places taken in arrival order, held one slice at most."""

from __future__ import annotations

import asyncio

import pytest

from cloche.sessions.gate import CellGate


async def test_places_are_given_in_arrival_order_and_never_more_than_the_slots():
    gate = CellGate(2, slice_s=60)
    running = 0
    most = 0
    order: list[int] = []
    release = asyncio.Event()
    two_in = asyncio.Event()

    async def cell(n: int) -> None:
        nonlocal running, most
        async with gate.admitted():
            running += 1
            most = max(most, running)
            order.append(n)
            if len(order) == 2:
                two_in.set()
            await release.wait()
            running -= 1

    tasks = []
    for n in range(8):
        tasks.append(asyncio.create_task(cell(n)))
        await asyncio.sleep(0)  # each asks in turn: 0 first, 7 last
    await two_in.wait()
    assert gate.waiting == 6
    release.set()
    await asyncio.gather(*tasks)
    assert order == list(range(8))
    assert most == 2
    assert gate.waiting == 0


async def test_a_cell_longer_than_its_slice_gives_its_place_up_once():
    gate = CellGate(1, slice_s=0.01)
    overran: list[str] = []
    long_cell_may_end = asyncio.Event()
    short_done = asyncio.Event()

    async def long_cell() -> None:
        async with gate.admitted(lambda: overran.append("long")):
            await long_cell_may_end.wait()

    async def short_cell() -> None:
        async with gate.admitted(lambda: overran.append("short")):
            short_done.set()

    long_task = asyncio.create_task(long_cell())
    await asyncio.sleep(0)
    short_task = asyncio.create_task(short_cell())
    # The short cell gets the only place while the long one still runs: its slice ended.
    await asyncio.wait_for(short_done.wait(), 10)
    assert not long_task.done()
    long_cell_may_end.set()
    await asyncio.gather(long_task, short_task)
    assert overran == ["long"]
    assert gate.overruns == 1
    # Both places are back: the gate is whole again, not short of one nor one over.
    async with gate.admitted():
        assert gate._free.locked()


async def test_a_cell_that_fails_gives_its_place_back():
    gate = CellGate(1, slice_s=60)
    with pytest.raises(RuntimeError):
        async with gate.admitted():
            raise RuntimeError("the kernel died")
    async with asyncio.timeout(5):
        async with gate.admitted():
            pass


async def test_a_waiter_that_gives_up_takes_no_place():
    gate = CellGate(1, slice_s=60)
    async with gate.admitted():
        waiter = asyncio.create_task(gate.admitted().__aenter__())
        await asyncio.sleep(0)
        assert gate.waiting == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    assert gate.waiting == 0
    async with asyncio.timeout(5):
        async with gate.admitted():
            pass


@pytest.mark.parametrize(("slots", "slice_s"), [(0, 1.0), (1, 0.0), (-1, 1.0)])
def test_a_gate_needs_a_place_and_a_slice(slots, slice_s):
    with pytest.raises(ValueError, match="at least one slot"):
        CellGate(slots, slice_s)


def test_more_long_busy_cells_than_cores_are_a_crowd():
    gate = CellGate(4, slice_s=0.05)
    gate.cores = 2
    for session in ("a", "b"):
        gate.note_long(session, busy=True)
    gate.note_long("sleeper", busy=False)  # a long cell that waits is not in it
    assert not gate.crowded
    gate.note_long("c", busy=True)
    assert gate.crowded
    gate.note_long("c", busy=True)  # seen busy again: counted once
    gate.note_long("a", busy=False)  # its cell ended
    assert not gate.crowded
