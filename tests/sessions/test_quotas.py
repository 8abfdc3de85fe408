"""The quota gate over a fake manager: waits for room, is woken by what makes some, refuses
after --quota-wait, queues an owner's cells, and gives a tenant's sessions its egress."""

from __future__ import annotations

import asyncio
import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import pytest

import cloche.sessions.quotas as quotas_module
from cloche.errors import QuotaExceeded, SessionBusy, SessionNotFound
from cloche.sessions.manager import SessionManager
from cloche.sessions.observer import Observer
from cloche.sessions.quotas import QuotaGate, Quotas, Terms
from cloche.sessions.session import SessionInfo, SessionState, owner_key

ALICE, BOB = "alice-token", "bob-token"


@dataclass
class FakeSnapshot:
    id: str
    size_bytes: int


class FakeManager:
    """Sessions as states in a dict, by owner: only what the gate calls."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[str | None, SessionState]] = {}
        self.snaps: dict[str, tuple[str | None, FakeSnapshot]] = {}
        self.created: list[dict[str, Any]] = []
        self.snapshot_size = 100
        self.running = 0
        self.most_running = 0
        self.release_cells = asyncio.Event()
        self.release_cells.set()
        self.cell_started = asyncio.Event()
        self._ids = itertools.count()

    async def running_at_least(self, count: int) -> None:
        while self.running < count:
            self.cell_started.clear()
            await self.cell_started.wait()

    def _info(self, session_id: str) -> SessionInfo:
        owner, state = self.held[session_id]
        return SessionInfo(session_id, owner_key(owner), state, 0.0, 0.0, 0, 0, "lean")

    def _find(self, session_id: str, owner: str | None) -> str:
        if self.held.get(session_id, (object(),))[0] != owner:
            raise SessionNotFound(session_id)
        return session_id

    async def create(self, owner=None, profile="lean", snapshot=None, egress=None, **more):
        self.created.append({"owner": owner, "snapshot": snapshot, "egress": egress, **more})
        session_id = f"s{next(self._ids)}"
        self.held[session_id] = (owner, SessionState.IDLE)
        return self._info(session_id)

    async def info(self, session_id, owner=None):
        return self._info(self._find(session_id, owner))

    async def sessions(self, owner=None, **filters):
        return [self._info(s) for s, (o, _) in self.held.items() if o == owner]

    async def close(self, session_id, owner=None, reason="closed"):
        del self.held[self._find(session_id, owner)]

    async def pause(self, session_id, owner=None):
        self.held[self._find(session_id, owner)] = (owner, SessionState.PAUSED)
        return self._info(session_id)

    async def resume(self, session_id, owner=None):
        self.held[self._find(session_id, owner)] = (owner, SessionState.IDLE)
        return self._info(session_id)

    async def fork(self, session_id, count=1, owner=None):
        self._find(session_id, owner)
        return [await self.create(owner) for _ in range(count)]

    async def execute(self, session_id, code, *, owner=None, **more):
        if self.held[self._find(session_id, owner)][1] is SessionState.PAUSED:
            self.held[session_id] = (owner, SessionState.IDLE)  # a cell brings it back
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        self.cell_started.set()
        try:
            await self.release_cells.wait()
        finally:
            self.running -= 1
        return code

    async def snapshot(self, session_id, owner=None, name=""):
        self._find(session_id, owner)
        record = FakeSnapshot(f"snap{next(self._ids)}", self.snapshot_size)
        self.snaps[record.id] = (owner, record)
        return record

    async def snapshots(self, owner=None):
        return [r for o, r in self.snaps.values() if o == owner]

    async def delete_snapshot(self, snapshot_id, owner=None):
        if self.snaps.get(snapshot_id, (object(),))[0] != owner:
            from cloche.errors import SnapshotNotFound

            raise SnapshotNotFound(snapshot_id)
        del self.snaps[snapshot_id]


class Told(Observer):
    def __init__(self) -> None:
        self.events: list[tuple[str, str | None, str | None, dict[str, Any]]] = []
        self.waiting = asyncio.Event()

    def event(self, kind, session_id, owner_key, data):
        self.events.append((kind, session_id, owner_key, data))
        if data.get("outcome") == "waiting":
            self.waiting.set()


def gate_for(inner: FakeManager, wait_s: float = 30.0, **quotas: int) -> tuple[QuotaGate, Told]:
    told = Told()
    terms = {owner_key(ALICE): Terms("alice", Quotas(**quotas), egress=None)}
    return QuotaGate(inner, terms.get, wait_s=wait_s, observer=told), told  # type: ignore[arg-type]


@pytest.fixture
def no_rechecks(monkeypatch):
    """Waiters look again only when woken: proves they are told, not polling."""
    monkeypatch.setattr(quotas_module, "RECHECK_S", 3600.0)


async def test_a_creation_over_the_live_quota_waits_and_a_close_lets_it_in(no_rechecks):
    inner = FakeManager()
    gate, told = gate_for(inner, max_live_sessions=1)
    first = await gate.create(ALICE)
    second = asyncio.create_task(gate.create(ALICE))
    await told.waiting.wait()
    assert not second.done() and len(inner.held) == 1
    await gate.close(first.id, ALICE)
    made = await second
    assert list(inner.held) == [made.id]
    kind, session_id, key, data = told.events[0]
    assert (kind, session_id, key) == ("quota.exceeded", None, owner_key(ALICE))
    assert data == {
        "tenant": "alice",
        "quota": "max_live_sessions",
        "limit": 1,
        "used": 1,
        "asked": 1,
        "outcome": "waiting",
        "wait_s": 30.0,
    }


async def test_a_pause_makes_room_for_a_live_session(no_rechecks):
    inner = FakeManager()
    gate, told = gate_for(inner, max_live_sessions=1)
    first = await gate.create(ALICE)
    second = asyncio.create_task(gate.create(ALICE))
    await told.waiting.wait()
    await gate.pause(first.id, ALICE)
    await second


async def test_a_session_that_ends_below_the_gate_lets_a_waiter_in_when_told(no_rechecks):
    inner = FakeManager()
    gate, told = gate_for(inner, max_live_sessions=1)
    first = await gate.create(ALICE)
    second = asyncio.create_task(gate.create(ALICE))
    await told.waiting.wait()
    del inner.held[first.id]  # expired on its own (idle timeout): the server's bus says so
    gate.changed(owner_key(BOB))  # another owner's change wakes nobody here
    await asyncio.sleep(0)
    assert not second.done()
    gate.changed(owner_key(ALICE))
    await second


async def test_nobody_told_a_waiter_still_finds_room_by_looking_again(monkeypatch):
    monkeypatch.setattr(quotas_module, "RECHECK_S", 0.01)
    inner = FakeManager()
    gate, told = gate_for(inner, max_live_sessions=1)
    first = await gate.create(ALICE)
    second = asyncio.create_task(gate.create(ALICE))
    await told.waiting.wait()
    del inner.held[first.id]
    await asyncio.wait_for(second, 10)


async def test_no_room_within_the_wait_is_refused_naming_the_quota_and_the_setting():
    inner = FakeManager()
    gate, told = gate_for(inner, wait_s=0.05, max_live_sessions=2)
    await gate.create(ALICE)
    await gate.create(ALICE)
    with pytest.raises(QuotaExceeded) as refused:
        await gate.create(ALICE)
    assert refused.value.quota == "max_live_sessions"
    assert refused.value.retry_after_s == 1.0
    message = str(refused.value)
    assert "tenant 'alice' is at its max_live_sessions quota of 2" in message
    assert "--quota-wait" in message and "--tokens" in message
    assert [e[3]["outcome"] for e in told.events] == ["waiting", "refused"]
    assert len(inner.held) == 2


async def test_without_a_wait_a_request_over_the_quota_is_refused_at_once():
    inner = FakeManager()
    gate, told = gate_for(inner, wait_s=0, max_live_sessions=1)
    await gate.create(ALICE)
    with pytest.raises(QuotaExceeded):
        await gate.create(ALICE)
    assert [e[3]["outcome"] for e in told.events] == ["refused"]


async def test_creations_at_once_never_take_the_owner_past_its_quota():
    inner = FakeManager()
    gate, _ = gate_for(inner, wait_s=0, max_live_sessions=3)
    results = await asyncio.gather(*(gate.create(ALICE) for _ in range(10)), return_exceptions=True)
    assert sum(isinstance(r, SessionInfo) for r in results) == 3
    assert all(isinstance(r, SessionInfo | QuotaExceeded) for r in results)
    assert len(inner.held) == 3


async def test_other_owners_and_owners_without_terms_are_not_held_back():
    inner = FakeManager()
    gate, _ = gate_for(inner, wait_s=0, max_live_sessions=1)
    await gate.create(ALICE)
    for _ in range(3):
        await gate.create(BOB)
        await gate.create(None)
    assert len(inner.held) == 7


async def test_fork_copies_count_and_more_than_the_quota_is_refused_at_once():
    inner = FakeManager()
    gate, _ = gate_for(inner, wait_s=30, max_live_sessions=3)
    original = await gate.create(ALICE)
    assert len(await gate.fork(original.id, 2, ALICE)) == 2
    with pytest.raises(QuotaExceeded, match="asks for 4, more than the quota allows"):
        await gate.fork(original.id, 4, ALICE)


async def test_resuming_a_paused_session_waits_for_live_room_by_request_or_by_cell(no_rechecks):
    inner = FakeManager()
    gate, told = gate_for(inner, wait_s=30, max_live_sessions=1)
    paused = await gate.create(ALICE)
    await gate.pause(paused.id, ALICE)
    live = await gate.create(ALICE)
    resumed = asyncio.create_task(gate.resume(paused.id, ALICE))
    await told.waiting.wait()
    told.waiting.clear()
    await gate.close(live.id, ALICE)
    assert (await resumed).state is SessionState.IDLE
    # A cell sent to a paused session brings it back: it waits as a resume does.
    await gate.pause(paused.id, ALICE)
    other = await gate.create(ALICE)
    cell = asyncio.create_task(gate.execute(paused.id, "1", owner=ALICE))
    await told.waiting.wait()
    assert inner.held[paused.id][1] is SessionState.PAUSED
    await gate.close(other.id, ALICE)
    assert await cell == "1"


async def test_a_pause_over_the_paused_quota_waits_for_a_paused_session_to_go(no_rechecks):
    inner = FakeManager()
    gate, told = gate_for(inner, wait_s=30, max_paused_sessions=1)
    first, second = await gate.create(ALICE), await gate.create(ALICE)
    await gate.pause(first.id, ALICE)
    pausing = asyncio.create_task(gate.pause(second.id, ALICE))
    await told.waiting.wait()
    assert told.events[0][3]["quota"] == "max_paused_sessions"
    await gate.resume(first.id, ALICE)
    assert (await pausing).state is SessionState.PAUSED
    await gate.pause(second.id, ALICE)  # already paused: nothing asked of the quota


async def test_an_owner_s_cells_beyond_its_running_quota_queue_and_all_run():
    inner = FakeManager()
    gate, _ = gate_for(inner, max_running_cells=2)
    sessions = [await gate.create(ALICE) for _ in range(4)]
    inner.release_cells.clear()
    cells = [
        asyncio.create_task(gate.execute(s.id, f"cell {i}", owner=ALICE))
        for i, s in enumerate(sessions)
    ]
    await inner.running_at_least(2)
    for _ in range(10):
        await asyncio.sleep(0)
    assert inner.running == 2  # the others wait at the gate, none failed
    bob = await gate.create(BOB)
    assert await asyncio.wait_for(_run_released(inner, gate, bob.id), 10) == "bob's"
    inner.release_cells.set()
    assert await asyncio.gather(*cells) == [f"cell {i}" for i in range(4)]
    assert inner.most_running == 3  # alice's two and bob's one


async def _run_released(inner: FakeManager, gate: QuotaGate, session_id: str) -> Any:
    """Bob's cell is not queued behind alice's: it runs while hers wait."""
    task = asyncio.create_task(gate.execute(session_id, "bob's", owner=BOB))
    await inner.running_at_least(3)
    inner.release_cells.set()
    result = await task
    inner.release_cells.clear()
    return result


async def test_a_cell_waiting_behind_its_session_s_running_cell_holds_no_place():
    inner = FakeManager()
    gate, _ = gate_for(inner, max_running_cells=1)
    gate.max_queued = 1
    first, second = await gate.create(ALICE), await gate.create(ALICE)
    order: list[str] = []
    released = {name: asyncio.Event() for name in ("a1", "a2", "b1")}
    started = asyncio.Event()

    async def execute(session_id, code, *, owner=None, **more):
        order.append(code)
        started.set()
        await released[code].wait()
        return code

    inner.execute = execute  # type: ignore[method-assign]
    a1 = asyncio.create_task(gate.execute(first.id, "a1", owner=ALICE))
    await started.wait()
    a2 = asyncio.create_task(gate.execute(first.id, "a2", owner=ALICE))
    await asyncio.sleep(0)
    b1 = asyncio.create_task(gate.execute(second.id, "b1", owner=ALICE))
    await asyncio.sleep(0)
    with pytest.raises(SessionBusy, match="already has 1 cells waiting"):
        await gate.execute(first.id, "a3", owner=ALICE)
    started.clear()
    released["a1"].set()
    await started.wait()
    assert order == ["a1", "b1"]  # a2 waited for its session, not for a place: b1 came first
    released["b1"].set()
    released["a2"].set()
    assert await asyncio.gather(a1, a2, b1) == ["a1", "a2", "b1"]
    assert gate._owners[owner_key(ALICE)].turns == {}


async def test_a_snapshot_over_the_byte_quota_is_deleted_again_and_refused():
    inner = FakeManager()
    gate, told = gate_for(inner, wait_s=0, max_snapshot_bytes=250)
    session = await gate.create(ALICE)
    await gate.snapshot(session.id, ALICE)
    await gate.snapshot(session.id, ALICE)
    with pytest.raises(QuotaExceeded, match="the snapshot took 100 bytes and it holds 200"):
        await gate.snapshot(session.id, ALICE)
    assert len(inner.snaps) == 2
    assert told.events[-1][3]["quota"] == "max_snapshot_bytes"


async def test_a_snapshot_at_the_byte_quota_waits_until_one_is_deleted(no_rechecks):
    inner = FakeManager()
    gate, told = gate_for(inner, wait_s=30, max_snapshot_bytes=200)
    session = await gate.create(ALICE)
    first = await gate.snapshot(session.id, ALICE)
    await gate.snapshot(session.id, ALICE)
    third = asyncio.create_task(gate.snapshot(session.id, ALICE))
    await told.waiting.wait()
    await gate.delete_snapshot(first.id, ALICE)
    await third
    assert len(inner.snaps) == 2


async def test_a_tenant_s_sessions_get_its_egress_policy_when_they_ask_for_none():
    inner = FakeManager()
    terms = {owner_key(ALICE): Terms("alice", Quotas(), egress="research")}
    gate = QuotaGate(inner, terms.get, wait_s=0)  # type: ignore[arg-type]
    await gate.create(ALICE)
    await gate.create(ALICE, egress="other")
    await gate.create(ALICE, egress={"allow": ["example.com:443"]})
    await gate.create(ALICE, snapshot="snap")  # a restored snapshot keeps its own
    await gate.create(BOB)
    asked = [(c["egress"], c["snapshot"]) for c in inner.created]
    assert asked == [
        ("research", None),
        ("other", None),
        ({"allow": ["example.com:443"], "policy": "research"}, None),
        (None, "snap"),
        (None, None),
    ]


def test_the_gate_passes_on_every_verb_of_the_manager():
    verbs = {
        name
        for name, _ in inspect.getmembers(SessionManager)
        if not name.startswith("_") and name != "create_and_execute"
    }
    # Its own, and those of the mixins that pass a group of verbs on (commands, files,
    # ports, volumes).
    passed = {
        name
        for base in QuotaGate.__mro__
        if base is QuotaGate or base.__name__.startswith("Forwarded")
        for name in vars(base)
    }
    missing = sorted(verb for verb in verbs if verb not in passed)
    assert missing == [], f"QuotaGate must pass these on to its inner manager: {missing}"
