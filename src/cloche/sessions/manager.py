"""The session manager: the one interface every front end uses to reach sessions.

`SessionManager` is abstract so that sessions can later live elsewhere (restored from
checkpoints, spread over machines); `LocalSessionManager` keeps them in this process.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import logging
import secrets
import time
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING

from cloche.config import ServerConfig
from cloche.errors import KernelDied, SessionNotFound, TooManySessions
from cloche.sandbox.base import Backend
from cloche.sandbox.files import WorkdirFiles
from cloche.server.metrics import Metrics
from cloche.sessions.kernel import EventCallback
from cloche.sessions.pool import WarmPool
from cloche.sessions.profiles import DATA, LEAN, get_profile
from cloche.sessions.result import CellResult, CellStatus
from cloche.sessions.session import Session, SessionInfo, SessionState

if TYPE_CHECKING:
    from cloche.llm.broker import Broker

log = logging.getLogger("cloche.session")


def new_session_id() -> str:
    """128 random bits, hex: unguessable, and safe in URLs and file names."""
    return secrets.token_hex(16)


class SessionManager(abc.ABC):
    """Creates, finds, runs, expires and closes sessions."""

    llm: Broker | None = None  # the language-model broker, when the server has one

    @abc.abstractmethod
    async def create(self, owner: str | None = None, profile: str = "lean") -> SessionInfo:
        """A new session of a profile (`lean` or `data`), from its warm pool when it can.

        Raises:
            UnknownProfile: no profile of that name.
            TooManySessions: the server is at --max-sessions.
            SandboxStartError: no sandbox could be started.
        """

    @abc.abstractmethod
    def get(self, session_id: str, owner: str | None = None) -> SessionInfo:
        """Raises SessionNotFound for an unknown id or another owner's session."""

    @abc.abstractmethod
    def list(self, owner: str | None = None) -> list[SessionInfo]:
        """The owner's sessions."""

    @abc.abstractmethod
    async def execute(
        self,
        session_id: str,
        code: str,
        *,
        owner: str | None = None,
        timeout_s: float | None = None,
        on_event: EventCallback | None = None,
        track_files: bool = False,
        silent: bool = False,
    ) -> CellResult:
        """Run a cell in a session (queued behind the running one).

        timeout_s is capped by the server's --cell-timeout. With track_files, the result
        lists the files the cell created or changed in the working directory. A silent
        cell (the server's own setup) runs in a namespace of its own and is not counted.

        Raises:
            SessionNotFound: unknown id, another owner's, or closed before the cell ran.
            SessionBusy: too many cells already waiting in this session.
        """

    async def create_and_execute(
        self,
        code: str,
        *,
        owner: str | None = None,
        timeout_s: float | None = None,
        on_event: EventCallback | None = None,
        profile: str = "lean",
    ) -> tuple[str, CellResult]:
        """Create a session and run a first cell in it; (session id, result)."""
        info = await self.create(owner, profile)
        result = await self.execute(
            info.id, code, owner=owner, timeout_s=timeout_s, on_event=on_event
        )
        return info.id, result

    @abc.abstractmethod
    def files(self, session_id: str, owner: str | None = None) -> WorkdirFiles:
        """The session's working directory (blocking methods: call them in a thread).

        Raises:
            SessionNotFound: unknown id or another owner's session.
        """

    @abc.abstractmethod
    async def interrupt(self, session_id: str, owner: str | None = None) -> bool:
        """Interrupt the running cell; False when none was running."""

    @abc.abstractmethod
    async def close(
        self, session_id: str, owner: str | None = None, reason: str = "closed"
    ) -> None:
        """Close a session. Raises SessionNotFound."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Get ready to serve (prepare the backend, fill the pool)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Interrupt running cells, close every session and sandbox."""

    @property
    @abc.abstractmethod
    def healthy(self) -> bool:
        """Whether a new session can be served now."""


class LocalSessionManager(SessionManager):
    """Sessions held in this process, each in its own sandbox from `backend`."""

    def __init__(self, config: ServerConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.limits = config.limits
        llm_setup = ""
        if config.llm is not None:  # every sandbox gets llm_query as it starts
            from cloche.llm.bridge import install_code

            llm_setup = install_code(config.llm, config.max_frame_bytes)
        self.pools = {
            profile.name: WarmPool(
                backend,
                config.limits,
                replace(
                    profile,
                    preload=profile.preload + llm_setup,
                    template=profile.template and config.data_template,
                ),
                size=size,
                max_frame_bytes=config.max_frame_bytes,
                start_concurrency=config.start_concurrency,
                max_size=config.pool_max,
            )
            for profile, size in ((LEAN, config.pool_size), (DATA, config.data_pool_size))
        }
        self.pool = self.pools[LEAN.name]
        self.metrics = Metrics()
        if config.llm is not None:
            from cloche.llm.broker import Broker

            self.llm = Broker(config.llm, self.metrics)
        for pool in self.pools.values():
            pool.on_start = self._sandbox_started
        self._sessions: dict[str, Session] = {}
        self._creating = 0
        self._reaper: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.closed_by_reason: Counter[str] = Counter()
        self.created = 0
        self._stopped = False

    async def start(self) -> None:
        await asyncio.to_thread(self.backend.prepare)
        for pool in self.pools.values():
            pool.start()
        self._reaper = asyncio.create_task(self._reap(), name="cloche-reaper")
        self.metrics.watch(self)

    def _sandbox_started(self, profile: str, seconds: float, ok: bool) -> None:
        if ok:
            self.metrics.sandbox_start.labels(profile).observe(seconds)
        else:
            self.metrics.sandbox_start_failures.labels(profile).inc()

    @property
    def healthy(self) -> bool:
        return not self._stopped and (self.pool.ready_count > 0 or self.pool.last_start_ok)

    async def create(self, owner: str | None = None, profile: str = "lean") -> SessionInfo:
        return (await self._create(owner, profile)).info()

    async def _create(self, owner: str | None, profile: str = "lean") -> Session:
        pool = self.pools[get_profile(profile).name]
        if self._stopped:
            raise TooManySessions("the server is shutting down")
        if len(self._sessions) + self._creating >= self.config.max_sessions:
            raise TooManySessions(
                f"the server already holds its maximum of {self.config.max_sessions} sessions "
                "(--max-sessions); close some or raise the limit"
            )
        self._creating += 1
        try:
            kernel = await pool.take()
        finally:
            self._creating -= 1
        session = Session(
            new_session_id(),
            kernel,
            owner,
            self.config.max_queued_cells,
            profile=profile,
            freeze_idle_s=self.config.limits.freeze_idle_s,
        )
        if self.llm is not None:
            from cloche.llm.bridge import KernelLLM

            kernel.llm = KernelLLM(self.llm, self.llm.budget(session.id), kernel)
        self._sessions[session.id] = session
        self.created += 1
        self.metrics.sessions_created.labels(profile).inc()
        log.info(
            "session start id=%s sandbox=%s profile=%s owner=%s",
            session.id,
            kernel.id,
            profile,
            _owner_tag(owner),
        )
        return session

    def _find(self, session_id: str, owner: str | None) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner or not session.usable:
            raise SessionNotFound(session_id)
        return session

    def get(self, session_id: str, owner: str | None = None) -> SessionInfo:
        return self._find(session_id, owner).info()

    def list(self, owner: str | None = None) -> list[SessionInfo]:
        return [s.info() for s in self._sessions.values() if s.owner == owner and s.usable]

    async def execute(
        self,
        session_id: str,
        code: str,
        *,
        owner: str | None = None,
        timeout_s: float | None = None,
        on_event: EventCallback | None = None,
        track_files: bool = False,
        silent: bool = False,
    ) -> CellResult:
        session = self._find(session_id, owner)
        limit = self.limits.cell_timeout_s
        timeout = min(timeout_s, limit) if timeout_s and timeout_s > 0 else limit
        started = time.perf_counter()
        try:
            result = await session.execute(
                code,
                timeout_s=timeout,
                on_event=on_event,
                track_files=track_files,
                silent=silent,
            )
        except KernelDied as exc:
            self._forget(session, "lost")
            raise SessionNotFound(session_id) from exc
        self.metrics.cell_finished(result, time.perf_counter() - started)
        if result.status is CellStatus.KILLED:
            self._forget(session, "killed")
        return result

    async def interrupt(self, session_id: str, owner: str | None = None) -> bool:
        return self._find(session_id, owner).interrupt()

    def files(self, session_id: str, owner: str | None = None) -> WorkdirFiles:
        return self._find(session_id, owner).files

    async def close(
        self, session_id: str, owner: str | None = None, reason: str = "closed"
    ) -> None:
        session = self._find(session_id, owner)
        self._remove(session, reason)
        await self._close(session, reason)

    def _remove(self, session: Session, reason: str) -> None:
        del self._sessions[session.id]
        self.closed_by_reason[reason] += 1
        self.metrics.sessions_closed.labels(reason).inc()

    async def _close(self, session: Session, reason: str) -> None:
        step = await session.close(reason)
        log.info(
            "session end id=%s reason=%s cells=%d exit=%s",
            session.id,
            reason,
            session.execution_count,
            step.value,
        )

    def _forget(self, session: Session, reason: str) -> None:
        """Drop a session whose sandbox died, freeing it in the background."""
        if self._sessions.get(session.id) is session:
            self._remove(session, reason)
            task = asyncio.create_task(self._close(session, reason))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _reap(self) -> None:
        """Close sessions past their idle timeout or lifetime, and drop dead ones."""
        limits = self.limits
        period = max(0.05, min(limits.idle_timeout_s / 10, 5.0))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            wall = time.time()
            for session in list(self._sessions.values()):
                if session.dead:
                    self._forget(session, "lost")
                elif (
                    session.state is SessionState.IDLE
                    and now - session.last_active > limits.idle_timeout_s
                ):
                    self._forget(session, "idle")
                elif wall - session.created_at > limits.lifetime_s:
                    self._forget(session, "lifetime")

    async def stop(self) -> None:
        self._stopped = True
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        sessions = list(self._sessions.values())
        for session in sessions:
            self._remove(session, "shutdown")
        await asyncio.gather(
            *(pool.close() for pool in self.pools.values()),
            *(self._close(s, "shutdown") for s in sessions),
            *self._closing,
            return_exceptions=True,
        )
        await asyncio.to_thread(self.backend.shutdown)
        if self.llm is not None:
            await self.llm.close()

    @property
    def session_count(self) -> int:
        return len(self._sessions)


def _owner_tag(owner: str | None) -> str:
    """A short, non-secret tag for a token in logs."""
    if owner is None:
        return "-"
    return hashlib.sha256(owner.encode()).hexdigest()[:8]
