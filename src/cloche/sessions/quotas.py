"""Tenants' quotas, below the front ends: a session manager that gates another.

`QuotaGate` wraps the server's manager (one machine's or a cluster's) and hands every
front end (HTTP, Terrarium, MCP, the Jupyter gateway, TCP) the same rules, by owner:

- `max_live_sessions`: a creation, a fork's copies, or the resume of a paused session
  (asked for, or brought back by a cell) waits for room; `max_paused_sessions`: a pause
  asked for does; `max_snapshot_bytes`: a snapshot does, and one that lands over the quota
  is deleted again; `max_volume_bytes`: a volume's creation does (its size counts from
  the start). Room is waited for up to `wait_s` (--quota-wait): a close, a pause, a
  resume or a deletion of the owner's, seen here or told by `changed` (the server's event
  bus), wakes the waiters; they look again every `RECHECK_S` for what nobody tells (a
  session that expired on a cluster's node). Then `QuotaExceeded`.
- `max_running_cells`: the owner's cells beyond it queue, in the order they came, as the
  cells of one session do; none fails. A session's cells take their turns here one at a
  time (so a cell waiting behind another of its session holds no place), at most
  `max_queued` waiting, as the session itself allows (`SessionBusy` beyond).

A quota hit is reported as a `quota.exceeded` event, once when a request starts waiting
(`outcome: waiting`) and once when it is refused (`outcome: refused`). The server's own
pauses (--pause-idle, room for --max-sessions, shutdown) are not held back by quotas.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import math
from collections import Counter
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
)
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cloche.config import MIB
from cloche.errors import QuotaExceeded, SessionBusy, SnapshotNotFound
from cloche.sessions.commands import ForwardedProcessVerbs
from cloche.sessions.filesystem import ForwardedFileVerbs
from cloche.sessions.forwarding import ForwardedSessionVerbs
from cloche.sessions.manager import EgressAsk, SessionManager
from cloche.sessions.observer import Observer
from cloche.sessions.ports import ForwardedPortVerbs
from cloche.sessions.result import CellResult
from cloche.sessions.session import SessionInfo, SessionState, owner_key
from cloche.sessions.store import SnapshotRecord
from cloche.sessions.volumes import ForwardedVolumeVerbs, VolumeInfo

LIVE = "max_live_sessions"
PAUSED = "max_paused_sessions"
CELLS = "max_running_cells"
SNAPSHOT_BYTES = "max_snapshot_bytes"
VOLUME_BYTES = "max_volume_bytes"
_T = TypeVar("_T")
RECHECK_S = 0.5  # a waiting request looks again this often, for changes nobody tells
_LIVE_STATES = frozenset({SessionState.IDLE, SessionState.BUSY})
_MAKES_ROOM = {
    LIVE: "close or pause one of its sessions",
    PAUSED: "close or resume one of its paused sessions",
    SNAPSHOT_BYTES: "delete one of its snapshots",
    VOLUME_BYTES: "delete one of its volumes",
}


@dataclass(frozen=True)
class Quotas:
    """What one tenant may hold at once; None: no limit."""

    max_live_sessions: int | None = None
    max_paused_sessions: int | None = None
    max_running_cells: int | None = None
    max_snapshot_bytes: int | None = None
    max_volume_bytes: int | None = None  # the sizes of its volumes together


@dataclass(frozen=True)
class Terms:
    """One tenant's terms: its name (for messages), its quotas, and the egress policy its
    sessions get when they ask for none."""

    tenant: str
    quotas: Quotas = Quotas()
    egress: str | None = None

    @property
    def gated(self) -> bool:
        """Whether the gate has anything to do for this tenant."""
        return self.egress is not None or self.quotas != Quotas()


@dataclass
class _Turns:
    """One session's cells at the gate: one at a time, in the order they came."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    count: int = 0  # the cell that holds the lock and those waiting for it


@dataclass
class _Owner:
    """An owner's state at the gate."""

    cells: asyncio.Semaphore | None  # its running cells, with max_running_cells
    turns: dict[str, _Turns] = field(default_factory=dict)  # by session, while cells wait
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one count-and-reserve at a time
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) on changes
    reserved: Counter[str] = field(default_factory=Counter)  # admitted, not yet counted


class QuotaGate(
    ForwardedSessionVerbs,
    ForwardedProcessVerbs,
    ForwardedFileVerbs,
    ForwardedPortVerbs,
    ForwardedVolumeVerbs,
    SessionManager,
):
    """`inner`, with each owner's `Terms` (`terms_of` its owner key; None: no terms) kept.

    Args:
        inner: the manager that holds the sessions.
        terms_of: an owner key (`sessions.session.owner_key`) to that owner's terms.
        wait_s: how long a request over a quota waits for room (--quota-wait).
        observer: told `quota.exceeded` events.
        max_queued: cells that may wait behind a session's running one (--max-queued-cells).
    """

    def __init__(
        self,
        inner: SessionManager,
        terms_of: Callable[[str], Terms | None],
        *,
        wait_s: float,
        observer: Observer | None = None,
        max_queued: int = 16,
    ) -> None:
        self.inner = inner
        self.wait_s = wait_s
        self.max_queued = max_queued
        self.observer = observer or Observer()
        self._terms_of = terms_of
        self._owners: dict[str, _Owner] = {}

    def changed(self, key: str | None) -> None:
        """Something of the owner's closed, paused, resumed or was deleted: its waiting
        requests look again. (For the server's event bus; never blocks.)"""
        state = self._owners.get(key) if key is not None else None
        if state is not None:
            state.wake.set()
            state.wake = asyncio.Event()

    # -- who, and on what terms ---------------------------------------------------------

    def _terms(self, owner: str | None) -> tuple[str, Terms] | None:
        key = owner_key(owner)
        if key is None:
            return None
        terms = self._terms_of(key)
        return (key, terms) if terms is not None and terms.gated else None

    def _owner(self, key: str, terms: Terms) -> _Owner:
        state = self._owners.get(key)
        if state is None:
            cells = terms.quotas.max_running_cells
            state = _Owner(asyncio.Semaphore(cells) if cells is not None else None)
            self._owners[key] = state
        return state

    async def _used(self, owner: str | None, quota: str) -> int:
        if quota == SNAPSHOT_BYTES:
            return sum(record.size_bytes for record in await self.inner.snapshots(owner))
        if quota == VOLUME_BYTES:
            return sum(v.size_mib * MIB for v in await self.inner.volumes(owner))
        states = _LIVE_STATES if quota == LIVE else frozenset({SessionState.PAUSED})
        return sum(1 for info in await self.inner.sessions(owner) if info.state in states)

    @contextlib.asynccontextmanager
    async def _room(
        self,
        owner: str | None,
        quota: str,
        asked: int = 1,
        session_id: str | None = None,
    ) -> AsyncIterator[None]:
        """Hold `asked` of the owner's `quota` while the body makes them (a session that is
        being made is not counted by the manager yet); wait for them first.

        Raises:
            QuotaExceeded: no room came within wait_s, or asked is above the quota.
        """
        found = self._terms(owner)
        limit = getattr(found[1].quotas, quota) if found is not None else None
        if found is None or limit is None:
            yield
            return
        key, terms = found
        state = self._owner(key, terms)
        held = await self._wait_for_room(owner, key, terms, state, quota, asked, limit, session_id)
        try:
            yield
        finally:
            state.reserved[quota] -= held
            self.changed(key)

    async def _wait_for_room(
        self,
        owner: str | None,
        key: str,
        terms: Terms,
        state: _Owner,
        quota: str,
        asked: int,
        limit: int,
        session_id: str | None,
    ) -> int:
        """Reserve asked of quota once the owner has room for them; what was reserved
        (bytes are not: a snapshot's size is known only once it is taken)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        told = False
        while True:
            async with state.lock:
                wake = state.wake  # taken before counting: a change meanwhile sets it
                used = await self._used(owner, quota) + state.reserved[quota]
                if used + asked <= limit:
                    held = 0 if quota == SNAPSHOT_BYTES else asked
                    state.reserved[quota] += held
                    return held
            left = deadline - loop.time()
            if asked > limit or left <= 0:
                self._tell(key, terms, quota, limit, used, asked, session_id, "refused")
                raise self._exceeded(terms, quota, limit, used, asked)
            if not told:
                self._tell(key, terms, quota, limit, used, asked, session_id, "waiting")
                told = True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, RECHECK_S)):
                    await wake.wait()

    def _tell(
        self,
        key: str,
        terms: Terms,
        quota: str,
        limit: int,
        used: int,
        asked: int,
        session_id: str | None,
        outcome: str,
    ) -> None:
        self.observer.event(
            "quota.exceeded",
            session_id,
            key,
            {
                "tenant": terms.tenant,
                "quota": quota,
                "limit": limit,
                "used": used,
                "asked": asked,
                "outcome": outcome,
                "wait_s": self.wait_s,
            },
        )

    def _exceeded(
        self, terms: Terms, quota: str, limit: int, used: int, asked: int
    ) -> QuotaExceeded:
        what = {SNAPSHOT_BYTES: "bytes of snapshots", VOLUME_BYTES: "bytes of volumes"}.get(
            quota, "of them"
        )
        if asked > limit and quota != SNAPSHOT_BYTES:
            why = f"this asks for {asked}, more than the quota allows at all"
        else:
            why = (
                f"it holds {used} {what}; no room came within {self.wait_s:g} s "
                f"(--quota-wait): {_MAKES_ROOM[quota]}"
            )
        return QuotaExceeded(
            f"tenant {terms.tenant!r} is at its {quota} quota of {limit}: {why}, or raise "
            f"{quota} in the --tokens file",
            quota=quota,
            retry_after_s=float(max(1, math.ceil(self.wait_s))),
        )

    def _egress(self, owner: str | None, asked: EgressAsk, snapshot: str | None) -> EgressAsk:
        """What a new session asks for: the tenant's policy when it asked for none (a
        restored snapshot keeps its own)."""
        found = self._terms(owner)
        default = found[1].egress if found is not None else None
        if default is None or snapshot is not None:
            return asked
        if asked is None:
            return default
        if isinstance(asked, Mapping) and "policy" not in asked:
            return {**asked, "policy": default}
        return asked

    async def _is_paused(self, session_id: str, owner: str | None) -> bool:
        return (await self.inner.info(session_id, owner)).state is SessionState.PAUSED

    def _has(self, owner: str | None, quota: str) -> bool:
        found = self._terms(owner)
        return found is not None and getattr(found[1].quotas, quota) is not None

    # -- the verbs that quotas gate -----------------------------------------------------

    async def create(
        self,
        owner: str | None = None,
        profile: str = "lean",
        snapshot: str | None = None,
        egress: EgressAsk = None,
        *more: Any,
        **named: Any,
    ) -> SessionInfo:
        asked = self._egress(owner, egress, snapshot)
        async with self._room(owner, LIVE):
            return await self.inner.create(owner, profile, snapshot, asked, *more, **named)

    async def fork(
        self, session_id: str, count: int = 1, owner: str | None = None, **more: Any
    ) -> builtins.list[SessionInfo]:
        async with self._room(owner, LIVE, count, session_id):
            return await self.inner.fork(session_id, count=count, owner=owner, **more)

    async def resume(self, session_id: str, owner: str | None = None) -> SessionInfo:
        if self._has(owner, LIVE) and await self._is_paused(session_id, owner):
            async with self._room(owner, LIVE, 1, session_id):
                return await self._changes(owner, self.inner.resume(session_id, owner))
        return await self._changes(owner, self.inner.resume(session_id, owner))

    async def pause(self, session_id: str, owner: str | None = None) -> SessionInfo:
        if self._has(owner, PAUSED) and not await self._is_paused(session_id, owner):
            async with self._room(owner, PAUSED, 1, session_id):
                return await self._changes(owner, self.inner.pause(session_id, owner))
        return await self._changes(owner, self.inner.pause(session_id, owner))

    async def snapshot(
        self, session_id: str, owner: str | None = None, name: str = "", **more: Any
    ) -> SnapshotRecord:
        found = self._terms(owner)
        limit = found[1].quotas.max_snapshot_bytes if found is not None else None
        if found is None or limit is None:
            return await self.inner.snapshot(session_id, owner=owner, name=name, **more)
        async with self._room(owner, SNAPSHOT_BYTES, 1, session_id):
            record = await self.inner.snapshot(session_id, owner=owner, name=name, **more)
        used = await self._used(owner, SNAPSHOT_BYTES)
        if used > limit:  # its size was known only once taken: it goes again
            with contextlib.suppress(SnapshotNotFound):
                await self.inner.delete_snapshot(record.id, owner)
            key, terms = found
            held = used - record.size_bytes
            self._tell(
                key, terms, SNAPSHOT_BYTES, limit, held, record.size_bytes, session_id, "refused"
            )
            raise QuotaExceeded(
                f"tenant {terms.tenant!r} is at its {SNAPSHOT_BYTES} quota of {limit}: the "
                f"snapshot took {record.size_bytes} bytes and it holds {held} (the snapshot "
                f"was deleted again): delete one of its snapshots, or raise {SNAPSHOT_BYTES} "
                "in the --tokens file",
                quota=SNAPSHOT_BYTES,
                retry_after_s=float(max(1, math.ceil(self.wait_s))),
            )
        return record

    async def create_volume(
        self, name: str, size_mib: int, owner: str | None = None, **more: Any
    ) -> VolumeInfo:
        asked = size_mib * MIB if isinstance(size_mib, int) else 0  # a bad one: inner says
        async with self._room(owner, VOLUME_BYTES, asked):
            return await self.inner.create_volume(name, size_mib, owner, **more)

    async def delete_volume(self, name: str, owner: str | None = None, **more: Any) -> None:
        await self._changes(owner, self.inner.delete_volume(name, owner, **more))

    async def execute(
        self, session_id: str, code: str, *, owner: str | None = None, **more: Any
    ) -> CellResult:
        found = self._terms(owner)
        if found is None:
            return await self.inner.execute(session_id, code, owner=owner, **more)
        key, terms = found
        if terms.quotas.max_live_sessions is not None and await self._is_paused(
            session_id, owner
        ):  # the cell would bring it back: as a resume, it waits for room
            await self.resume(session_id, owner)
        state = self._owner(key, terms)
        if state.cells is None:
            return await self.inner.execute(session_id, code, owner=owner, **more)
        turns = state.turns.setdefault(session_id, _Turns())
        if turns.count > self.max_queued:
            raise SessionBusy(
                f"session {session_id} already has {turns.count - 1} cells waiting "
                f"(limit {self.max_queued}); wait for them to finish"
            )
        turns.count += 1
        try:
            async with turns.lock, state.cells:  # beyond max_running_cells, cells queue here
                return await self.inner.execute(session_id, code, owner=owner, **more)
        finally:
            turns.count -= 1
            if turns.count == 0:
                del state.turns[session_id]

    async def close(
        self, session_id: str, owner: str | None = None, reason: str = "closed", **more: Any
    ) -> None:
        await self._changes(owner, self.inner.close(session_id, owner, reason=reason, **more))

    async def delete_snapshot(self, snapshot_id: str, owner: str | None = None) -> None:
        await self._changes(owner, self.inner.delete_snapshot(snapshot_id, owner))

    async def _changes(self, owner: str | None, step: Awaitable[_T]) -> _T:
        """Await step; then the owner's waiting requests look again (whatever came of it)."""
        try:
            return await step
        finally:
            self.changed(owner_key(owner))

    def __getattr__(self, name: str) -> Any:
        """What the inner manager has beyond the interface (its profiles, say)."""
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
