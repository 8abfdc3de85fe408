"""Live sessions of one machine: find, list, close, expire.

The first layer of `LocalSessionManager` (`sessions.local`): what a session is while its
sandbox runs. Making one is the next layer's (`sessions.creation`), what it does meanwhile
(cells, files) the layer after (`sessions.running`); saving one (pause, snapshot, fork)
the layers after that (`sessions.durability`, `sessions.copies`), which this one calls
through the abstract methods at its end.
"""

from __future__ import annotations

import abc
import asyncio
import builtins
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloche.config import MIB, ServerConfig
from cloche.errors import SessionLost, SessionMoved, SessionNotFound, UnknownProfile
from cloche.packages.installer import Installer
from cloche.packages.profiles import ProfileCatalog
from cloche.sandbox.base import Backend
from cloche.sandbox.layers import System
from cloche.sessions.doors import SessionDoors
from cloche.sessions.durable import Checkpoints
from cloche.sessions.ends import Ends
from cloche.sessions.gate import SLOTS_PER_CORE, CellGate
from cloche.sessions.hookups import LLMHookup, TemplateSystems
from cloche.sessions.kernel import KernelClient
from cloche.sessions.manager import SessionManager, matches
from cloche.sessions.observer import Observer
from cloche.sessions.pool import WarmPool
from cloche.sessions.pools import ProfilePools
from cloche.sessions.profiles import PYTHON
from cloche.sessions.session import Session, SessionInfo, SessionState, owner_key
from cloche.sessions.store import SnapshotRecord, Store

if TYPE_CHECKING:
    from cloche.network.egress.service import Egress

log = logging.getLogger("cloche.session")


class LiveSessions(SessionManager):
    """Sessions held in this process, each in its own sandbox from `backend`; paused ones
    and snapshots on disk under --data-dir. What happens is told to `observer` (the
    server's metrics; by default nobody)."""

    def __init__(
        self,
        config: ServerConfig,
        backend: Backend,
        observer: Observer | None = None,
        egress: Egress | None = None,
        llm: LLMHookup | None = None,
        templates: TemplateSystems | None = None,
    ) -> None:
        self.config = config
        # The templates sessions may be made of, beside python (`templates()` is a verb)
        self.template_systems = templates
        self.egress = egress  # the server's egress policies
        self.doors = SessionDoors(egress)  # the sessions' ways out, by session id
        self.backend = backend
        self.limits = config.limits
        self.llm = llm  # llm_query for the sessions' cells, when the server has a model
        self.observer = observer or Observer()
        self.installer = Installer(
            config.packages, sys.executable, config.runtime_dir, self.observer
        )
        setup = llm.setup_code if llm is not None else ""  # run by every new sandbox
        self.profile_pools = ProfilePools(
            config, backend, self.observer, self.installer, setup, self._system_of
        )
        self.store = Store(config.data_dir, config.data_max_mib * MIB)
        self.checkpoints = Checkpoints(self.store, backend, config.limits, config.max_frame_bytes)
        self._sessions: dict[str, Session] = {}
        slots = config.cell_slots or SLOTS_PER_CORE * (os.cpu_count() or 1)
        self.gate = CellGate(slots, config.cell_slice_s)
        # Sessions gone for good, told as lost until their lifetime ends: id -> (owner key,
        # why, unix time of their creation)
        self._lost: dict[str, tuple[str | None, str, float]] = {}
        self._snapshots: dict[str, SnapshotRecord] = {}
        # Sessions being handed to another node: their requests wait for the move's end
        self._moving: dict[str, asyncio.Event] = {}
        self._moved: set[str] = set()  # handed over: asked here, they say where to look
        self._creating = 0
        self._reaper: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._pausing: dict[str, asyncio.Task[None]] = {}  # page-outs under way
        self._page_outs = asyncio.Semaphore(config.pause_concurrency)
        self._restores = asyncio.Semaphore(os.cpu_count() or 1)
        self.ends = Ends(self.observer, self._in_background)
        self.created = 0
        self._stopped = False

    @property
    def pools(self) -> dict[str, WarmPool]:
        """The warm pool of each profile, by name."""
        return self.profile_pools.by_name

    @property
    def pool(self) -> WarmPool:
        """The lean profile's pool."""
        return self.profile_pools.lean

    @property
    def catalog(self) -> ProfileCatalog | None:
        """The profiles of --profiles, if any."""
        return self.profile_pools.catalog

    @catalog.setter
    def catalog(self, catalog: ProfileCatalog | None) -> None:
        self.profile_pools.catalog = catalog

    async def wait_ready(self, profile: str = "lean", timeout_s: float = 120.0) -> None:
        await self.profile_pools.wait_ready(profile, timeout_s)

    async def _pool(self, name: str, template: str = PYTHON) -> WarmPool:
        return await self.profile_pools.get(name, template)

    def _system_of(self, template: str) -> System:
        """A template's system, for its sessions' sandboxes.

        Raises:
            TemplateNotFound, TemplateNotReady, TemplateFailed: it can't serve.
        """
        if self.template_systems is None:
            raise UnknownProfile(f"no template {template!r} here: this server has python alone")
        return self.template_systems.system(template)

    def profiles(self) -> list[dict[str, Any]]:
        """Every profile with its state and packages (blocking: reads runtimes' listings)."""
        return self.profile_pools.describe()

    @property
    def metrics(self) -> Observer:
        """The observer, under the name tools and tests read the server's metrics by."""
        return self.observer

    @property
    def healthy(self) -> bool:
        return not self._stopped and (self.pool.ready_count > 0 or self.pool.last_start_ok)

    def _tell(self, kind: str, session: Session, data: dict[str, Any]) -> None:
        """An event about a session, for the server's events and webhooks."""
        self.observer.event(kind, session.id, session.owner_key, data)

    def _runtime_of(self, profile: str) -> Path | None:
        return self.profile_pools.runtime_of(profile)

    @property
    def live_count(self) -> int:
        return len(self._sessions) - self.paused_count + self._creating

    @property
    def paused_count(self) -> int:
        return sum(1 for s in self._sessions.values() if s.paused)

    def _find(self, session_id: str, owner: str | None) -> Session:
        if session_id in self._moved:
            raise SessionMoved(session_id)
        session = self._sessions.get(session_id)
        key = owner_key(owner)
        if session is None or session.owner_key != key or not session.usable:
            lost = self._lost.get(session_id)
            if lost is not None and lost[0] == key:
                raise SessionLost(session_id, lost[1])
            raise SessionNotFound(session_id)
        return session

    async def info(self, session_id: str, owner: str | None = None) -> SessionInfo:
        return self.get(session_id, owner)

    async def sessions(
        self,
        owner: str | None = None,
        *,
        every: bool = False,
        state: str | None = None,
        profile: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> list[SessionInfo]:
        found = self.list(owner, every=every)
        return [info for info in found if matches(info, state, profile, metadata)]

    def get(self, session_id: str, owner: str | None = None) -> SessionInfo:
        """`info`, for code on the server's own loop (and tests)."""
        return self._find(session_id, owner).info()

    def session_ids(self) -> builtins.list[str]:
        """Every session held here, whoever owns it, paused ones too."""
        return builtins.list(self._sessions)

    def snapshot_ids(self) -> builtins.list[str]:
        return builtins.list(self._snapshots)

    def list(self, owner: str | None = None, *, every: bool = False) -> list[SessionInfo]:
        """`sessions`, for code on the server's own loop (and tests)."""
        key = owner_key(owner)
        return [
            s.info(usage=True)
            for s in self._sessions.values()
            if (every or s.owner_key == key) and s.usable
        ]

    async def close(
        self, session_id: str, owner: str | None = None, reason: str = "closed"
    ) -> None:
        session = self._find(session_id, owner)
        self._remove(session, reason)
        await self._close(session, reason)

    def _remove(self, session: Session, reason: str) -> None:
        del self._sessions[session.id]
        self.ends.add(session, reason)

    @property
    def closed_by_reason(self) -> Counter[str]:
        """How many sessions ended, by the manager's word for the end."""
        return self.ends.by_reason

    @property
    def ended_seq(self) -> int:
        """The number of the last session that ended here on its own."""
        return self.ends.seq

    def ended_since(self, seq: int) -> builtins.list[str]:
        """Sessions that ended here on their own (idle timeout, lifetime) after the
        `ended_seq` seq, oldest first (the last ENDED_KEPT): a cluster's directory forgets
        them, as it forgets those a front end closed."""
        return self.ends.since(seq)

    async def _close(self, session: Session, reason: str) -> None:
        await self.doors.close(session.id)
        step = await session.close(reason)
        await asyncio.to_thread(self.store.remove, self.store.session_dir(session.id))
        log.info(
            "session end id=%s reason=%s cells=%d exit=%s",
            session.id,
            reason,
            session.execution_count,
            step.value,
        )

    async def _close_kernel(self, kernel: KernelClient, why: str) -> None:
        await kernel.close(why=f"the session was {why}")

    def _in_background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _forget(self, session: Session, reason: str) -> None:
        """Drop a session whose sandbox died, freeing it in the background."""
        if self._sessions.get(session.id) is session:
            self._remove(session, reason)
            self._in_background(self._close(session, reason))

    async def _reap(self) -> None:
        """Close sessions past their idle timeout or lifetime, page out idle ones, and drop
        dead ones."""
        limits = self.limits
        shortest = min(x for x in (limits.idle_timeout_s, limits.pause_idle_s or 1e9) if x > 0)
        period = max(0.05, min(shortest / 10, 5.0))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            wall = time.time()
            for session in list(self._sessions.values()):
                idle_s = 0.0 if session.in_use else now - session.last_active
                if session.dead:
                    self._forget(session, "lost")
                elif session.state in (SessionState.IDLE, SessionState.PAUSED) and (
                    idle_s > limits.idle_timeout_s
                ):
                    self._forget(session, "idle")
                elif wall - session.created_at > limits.lifetime_s:
                    self._forget(session, "lifetime")
                elif (
                    session.state is SessionState.IDLE
                    and self.backend.can_checkpoint
                    and 0 < limits.pause_idle_s < idle_s
                    and session.id not in self._pausing
                ):
                    self._page_out(session)
            for session_id, (_, _, created_at) in list(self._lost.items()):
                if wall - created_at > limits.lifetime_s:  # no longer worth telling
                    del self._lost[session_id]
                    home = self.store.session_dir(session_id)
                    self._in_background(asyncio.to_thread(self.store.remove, home))

    @property
    def session_count(self) -> int:
        return len(self._sessions) - self.paused_count

    # -- the durability layers' (sessions.durability, sessions.copies) ---------------------

    @abc.abstractmethod
    async def _room_for(self, count: int) -> None:
        """Make sure count more sessions may run (paging idle ones out if it must).

        Raises:
            TooManySessions: it can't.
        """

    @abc.abstractmethod
    async def _pause(self, session: Session, reason: str, *, interrupt: bool = False) -> None:
        """Save a session to disk and stop its sandbox."""

    @abc.abstractmethod
    async def _wake(self, session: Session) -> None:
        """Restore a paused session's image into a new sandbox."""

    @abc.abstractmethod
    def _page_out(self, session: Session) -> None:
        """Pause an idle session in the background."""

    @abc.abstractmethod
    def _snapshot(self, snapshot_id: str, owner: str | None = None) -> SnapshotRecord:
        """The owner's snapshot. Raises SnapshotNotFound."""

    @abc.abstractmethod
    async def _from_snapshot(
        self, snapshot_id: str, owner: str | None, metadata: dict[str, str] | None = None
    ) -> Session:
        """A new session restored from a snapshot (with its metadata, or metadata)."""
