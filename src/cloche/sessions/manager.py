"""The session manager: the one interface every front end uses to reach sessions.

`SessionManager` is abstract so that sessions can later live elsewhere (restored from
checkpoints, spread over machines); `LocalSessionManager` keeps them in this process.
"""

from __future__ import annotations

import abc
import asyncio
import builtins
import logging
import os
import sys
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterable, Coroutine, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloche.config import MIB, Limits, ServerConfig
from cloche.errors import (
    CheckpointFailed,
    ClocheError,
    EgressRefused,
    ForkRefused,
    KernelDied,
    NodeNotFound,
    PackageInstallError,
    RestoreRefused,
    SandboxError,
    SandboxStartError,
    SessionLost,
    SessionMoved,
    SessionNotFound,
    SnapshotNotFound,
    TooManyPausedSessions,
    TooManySessions,
    UnknownProfile,
)
from cloche.packages.bridge import KernelPip
from cloche.packages.installer import Installer
from cloche.packages.profiles import ProfileCatalog, ProfileStatus, describe, file_profiles
from cloche.protocol.paths import normalise
from cloche.sandbox.base import Backend
from cloche.sandbox.files import FileListing, StreamedFile, WorkdirFiles
from cloche.sessions.durable import Checkpoints, carry_disk, pack_home, unpack_home
from cloche.sessions.gate import SLOTS_PER_CORE, CellGate
from cloche.sessions.kernel import EventCallback, KernelClient
from cloche.sessions.observer import Observer
from cloche.sessions.pool import WarmPool
from cloche.sessions.profiles import DATA, LEAN, Profile, get_profile
from cloche.sessions.result import CellResult, CellStatus
from cloche.sessions.session import Session, SessionInfo, SessionState, owner_key
from cloche.sessions.store import RecordState, SessionRecord, SnapshotRecord, Store

if TYPE_CHECKING:
    from cloche.egress.policy import Policy
    from cloche.egress.proxy import Door
    from cloche.egress.service import Egress
    from cloche.llm.broker import Broker

log = logging.getLogger("cloche.session")

InstalledPackages = list[dict[str, str]]  # [{"name", "version"}]
EgressAsk = str | Mapping[str, Any] | None  # a policy's name, or {"policy", "allow"}
DOOR_OPEN_TIMEOUT_S = 30.0
_OPEN_DOOR = "from cloche.kernel import egress as _egress\n_egress.open_door({args})"
_DROP_CONNECTIONS = "from cloche.kernel import egress as _egress\n_egress.drop_connections()"
ENDED_KEPT = 10_000  # sessions that ended on their own, remembered for a cluster's directory
_EXPIRED = frozenset({"idle", "lifetime"})  # ends no front end asked for
STREAM_FLUSH_BYTES = 1 << 20  # a streamed file is written in pieces of about this size
PROFILE_WAIT_S = 30.0  # a new session of a profile still building waits this long, then 503


def new_session_id() -> str:
    """A random UUID (122 bits from the OS's CSPRNG): unguessable, safe in URLs and file
    names, and the shape jupyter_server's routes require of a kernel id (it is one)."""
    return str(uuid.uuid4())


class SessionManager(abc.ABC):
    """Creates, finds, runs, expires and closes sessions."""

    llm: Broker | None = None  # the language-model broker, when the server has one

    @abc.abstractmethod
    async def create(
        self,
        owner: str | None = None,
        profile: str = "lean",
        snapshot: str | None = None,
        egress: EgressAsk = None,
    ) -> SessionInfo:
        """A new session of a profile (`lean` or `data`), from its warm pool when it can;
        or, given a snapshot id, a new session restored from that snapshot. `egress` asks
        for a policy of the server's (a name, or {policy, allow} to narrow one); nothing
        asked gets the server's `default` policy, if it has one.

        Raises:
            EgressRefused: an unknown policy, a rule wider than it, or no egress here.
            UnknownProfile: no profile of that name.
            TooManySessions: the server is at --max-sessions.
            SandboxStartError: no sandbox could be started.
            SnapshotNotFound: unknown snapshot, or another owner's.
            RestoreRefused: the snapshot's image can't be restored here.
        """

    @abc.abstractmethod
    async def info(self, session_id: str, owner: str | None = None) -> SessionInfo:
        """Raises SessionNotFound for an unknown id or another owner's session, SessionLost
        for one that was live when a previous server died (or whose node failed)."""

    @abc.abstractmethod
    async def sessions(self, owner: str | None = None) -> list[SessionInfo]:
        """The owner's sessions."""

    # -- durability -----------------------------------------------------------------------

    @abc.abstractmethod
    async def snapshot(
        self, session_id: str, owner: str | None = None, name: str = ""
    ) -> SnapshotRecord:
        """Save the session as it is between cells; it goes on running, unaffected.

        Raises:
            SessionNotFound, SessionLost: as for `get`.
            StorageFull, CheckpointFailed: it could not be saved (it keeps running).
        """

    @abc.abstractmethod
    async def snapshots(self, owner: str | None = None) -> builtins.list[SnapshotRecord]:
        """The owner's snapshots, oldest first."""

    @abc.abstractmethod
    async def get_snapshot(self, snapshot_id: str, owner: str | None = None) -> SnapshotRecord:
        """Raises SnapshotNotFound for an unknown id or another owner's snapshot."""

    @abc.abstractmethod
    async def delete_snapshot(self, snapshot_id: str, owner: str | None = None) -> None:
        """Delete a snapshot and its image. Raises SnapshotNotFound."""

    @abc.abstractmethod
    async def fork(
        self, session_id: str, count: int = 1, owner: str | None = None
    ) -> list[SessionInfo]:
        """count new sessions, each a copy of the session as it is now (between cells);
        the original goes on running.

        Raises:
            SessionNotFound, SessionLost: as for `get`.
            TooManySessions: the copies would take the server past --max-sessions.
            CheckpointFailed, RestoreRefused: the copies could not be made.
        """

    @abc.abstractmethod
    async def pause(self, session_id: str, owner: str | None = None) -> SessionInfo:
        """Save the session to disk and stop its sandbox, after its running cell."""

    @abc.abstractmethod
    async def resume(self, session_id: str, owner: str | None = None) -> SessionInfo:
        """Bring a paused session back now (any request to it does so by itself)."""

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
        stdin: bool = False,
        pager: bool = False,
    ) -> CellResult:
        """Run a cell in a session (queued behind the running one).

        timeout_s is capped by the server's --cell-timeout. With track_files, the result
        lists the files the cell created or changed in the working directory. A silent
        cell (the server's own setup) runs in a namespace of its own and is not counted.
        With stdin (and on_event), the cell's input() and getpass() send on_event an
        {"type": "input_request", "prompt", "password"} event, answered by `answer_input`;
        without, they raise StdinNotImplementedError in the cell. With pager (and on_event),
        `obj?` sends on_event a {"type": "page", "text"} event instead of printing.

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

    # -- the working directory: a paused session is brought back first -------------------

    @abc.abstractmethod
    async def list_files(self, session_id: str, owner: str | None = None) -> FileListing:
        """The regular files of the session's working directory.

        Raises:
            SessionNotFound: unknown id or another owner's session.
        """

    @abc.abstractmethod
    async def read_file(self, session_id: str, path: str, owner: str | None = None) -> bytes:
        """A file of the working directory. Raises PathRefused, PathNotFound, SessionNotFound."""

    @abc.abstractmethod
    async def write_files(
        self, session_id: str, files: Sequence[tuple[str, bytes]], owner: str | None = None
    ) -> None:
        """Create or replace files (path, content), in order. Raises PathRefused (then the
        files before the refused one are written), SessionNotFound."""

    @abc.abstractmethod
    async def write_stream(
        self,
        session_id: str,
        path: str,
        chunks: AsyncIterable[bytes],
        owner: str | None = None,
    ) -> int:
        """Create or replace a file at the root of the working directory from chunks of
        unknown total size; its size in bytes. Nothing is left of it when it fails.

        Raises:
            PathRefused: a bad name, over the size of the working directory, or disk full.
            SessionNotFound: unknown id or another owner's session.
        """

    async def install_packages(
        self, session_id: str, specs: Sequence[str], owner: str | None = None
    ) -> InstalledPackages:
        """Install packages into a session, queued as a cell; [{name, version}] installed.

        Raises:
            SessionNotFound: unknown id or another owner's session.
            PackageInstallError: refused or failed; the session is as it was.
        """
        raise PackageInstallError(f"{type(self).__name__} can't install packages")

    @abc.abstractmethod
    async def interrupt(self, session_id: str, owner: str | None = None) -> bool:
        """Interrupt the running cell; False when none was running. A paused session is
        brought back first."""

    @abc.abstractmethod
    async def restart(self, session_id: str, owner: str | None = None) -> SessionInfo:
        """A fresh interpreter for the session, same id: its running cell is stopped, its
        variables and imports are gone (its working directory stays). A paused session is
        brought back first. Raises SessionNotFound."""

    @abc.abstractmethod
    async def answer_input(self, session_id: str, value: str, owner: str | None = None) -> bool:
        """Give the value to the running cell's input(); False when no input() waits.
        Raises SessionNotFound."""

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

    @abc.abstractmethod
    async def wait_ready(self, profile: str = "lean", timeout_s: float = 120.0) -> None:
        """Wait until the pools of a profile hold their ready sandboxes (start-up, tests)."""

    async def node_metrics(self) -> dict[str, str]:
        """Prometheus text of each node that holds sessions for this manager, by node id,
        for /metrics to label `node` (a cluster's); empty on one machine."""
        return {}

    def cluster_view(self) -> dict[str, Any] | None:
        """GET /v1/cluster: the Ray cluster's address and its nodes; None on one machine."""
        return None

    async def drain(self, node_id: str) -> dict[str, Any]:
        """Move a node's sessions to the other nodes. Raises NodeNotFound."""
        raise NodeNotFound("this server is not a cluster (start it with --cluster)")

    async def undrain(self, node_id: str) -> dict[str, Any]:
        """Return a draining node to service. Raises NodeNotFound."""
        raise NodeNotFound("this server is not a cluster (start it with --cluster)")


class LocalSessionManager(SessionManager):
    """Sessions held in this process, each in its own sandbox from `backend`; paused ones
    and snapshots on disk under --data-dir. What happens is told to `observer` (the
    server's metrics; by default nobody)."""

    def __init__(
        self,
        config: ServerConfig,
        backend: Backend,
        observer: Observer | None = None,
        egress: Egress | None = None,
    ) -> None:
        self.config = config
        self.egress = egress  # the server's egress policies and the sessions' doors
        self._doors: dict[str, Door] = {}  # by session id
        self.backend = backend
        self.limits = config.limits
        llm_setup = ""
        if config.llm is not None:  # every sandbox gets llm_query as it starts
            from cloche.llm.bridge import install_code

            llm_setup = install_code(config.llm, config.max_frame_bytes)
        self._llm_setup = llm_setup
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
        self.observer = observer or Observer()
        self.installer = Installer(
            config.packages, sys.executable, config.runtime_dir, self.observer
        )
        self.catalog: ProfileCatalog | None = None  # profiles from --profiles
        if config.profiles_file is not None:
            self.catalog = file_profiles(
                config.profiles_file,
                config.limits.memory_mib,
                self.installer.pip,
                self.installer.cache,
                self._profile_ready,
            )
        if config.llm is not None:
            from cloche.llm.broker import Broker

            self.llm = Broker(config.llm, self.observer)
        for pool in self.pools.values():
            pool.on_start = self._sandbox_started
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
        self.closed_by_reason: Counter[str] = Counter()
        # Sessions that ended on their own (see ended_since), numbered from 1.
        self._ended: deque[tuple[int, str]] = deque(maxlen=ENDED_KEPT)
        self.ended_seq = 0
        self.created = 0
        self._stopped = False

    async def start(self) -> None:
        await asyncio.to_thread(self.backend.prepare)
        try:
            await asyncio.to_thread(self.store.open)
            await asyncio.to_thread(self._load)
        except BaseException:
            await asyncio.to_thread(self.backend.shutdown)
            raise
        await asyncio.to_thread(self.installer.prepare)
        for pool in self.pools.values():
            pool.start()
        self._reaper = asyncio.create_task(self._reap(), name="cloche-reaper")
        if self.catalog is not None:
            self.catalog.start()

    async def wait_ready(self, profile: str = "lean", timeout_s: float = 120.0) -> None:
        if profile in self.pools:
            await self.pools[profile].wait_full(timeout_s)

    def _profile_ready(self, status: ProfileStatus) -> None:
        """A profile of the file has its runtime: start its pool."""
        spec = status.spec
        assert spec is not None
        limits = self.limits
        if spec.memory_mib is not None:
            limits = replace(limits, memory_mib=spec.memory_mib)
        profile = Profile(
            spec.name, preload=spec.preload_code + self._llm_setup, runtime_dir=status.runtime_dir
        )
        pool = WarmPool(
            self.backend,
            limits,
            profile,
            size=spec.pool,
            max_frame_bytes=self.config.max_frame_bytes,
            start_concurrency=self.config.start_concurrency,
        )
        pool.on_start = self._sandbox_started
        self.pools[spec.name] = pool
        if not self._stopped:
            pool.start()

    async def _pool(self, name: str) -> WarmPool:
        """The pool of a profile; one of the file waits while it builds (up to a limit)."""
        if name in self.pools:
            return self.pools[name]
        status = None
        if self.catalog is not None:
            try:
                status = await self.catalog.wait(name, PROFILE_WAIT_S)
            except TimeoutError:
                raise SandboxStartError(
                    f"profile {name!r} is still building its runtime; try again shortly "
                    "(GET /v1/profiles shows its state)"
                ) from None
        if status is not None and name not in self.pools:
            raise UnknownProfile(status.error or f"profile {name!r} can't serve")
        return self.pools.get(name) or self.pools[get_profile(name).name]

    def profiles(self) -> list[dict[str, Any]]:
        """Every profile with its state and packages (blocking: reads runtimes' listings)."""
        return describe(self.catalog, self.config.runtime_dir)

    def _load(self) -> None:
        """Take over what a previous server left in the data directory (blocking)."""
        for snapshot in self.store.snapshot_records():
            self._snapshots[snapshot.id] = snapshot
        for record in self.store.session_records():
            if record.state is RecordState.PAUSED:
                self._sessions[record.id] = self._paused_session(record)
                continue
            if record.state is RecordState.LIVE:  # its server died with it
                record = replace(record, state=RecordState.LOST)
                self.store.save(record)
                self.checkpoints.discard(self.store.session_dir(record.id))
            self._lost[record.id] = (
                record.owner_key,
                "when the server stopped unexpectedly",
                record.created_at,
            )
        log.info(
            "data dir %s: %d paused sessions, %d lost, %d snapshots",
            self.store.root,
            self.paused_count,
            len(self._lost),
            len(self._snapshots),
        )

    def _sandbox_started(self, profile: str, seconds: float, ok: bool) -> None:
        if ok:
            self.observer.sandbox_started(profile, seconds)
        else:
            self.observer.sandbox_start_failed(profile)

    @property
    def metrics(self) -> Observer:
        """The observer, under the name tools and tests read the server's metrics by."""
        return self.observer

    @property
    def healthy(self) -> bool:
        return not self._stopped and (self.pool.ready_count > 0 or self.pool.last_start_ok)

    # -- creating and finding ---------------------------------------------------------------

    async def create(
        self,
        owner: str | None = None,
        profile: str = "lean",
        snapshot: str | None = None,
        egress: EgressAsk = None,
    ) -> SessionInfo:
        if egress is None and self.catalog is not None:  # the profile's own, if it has one
            status = self.catalog.statuses.get(profile)
            if status is not None and status.spec is not None:
                egress = status.spec.egress
        policy = self._egress_for(egress)
        placeholders: dict[str, str] = {}
        if snapshot is not None:
            taken = self._snapshot(snapshot, owner).egress
            placeholders = _placeholders_of(taken)  # in the image's memory
            if egress is None:  # the snapshot's own, as it was taken
                policy = self._policy_again(taken, snapshot)
            session = await self._from_snapshot(snapshot, owner)
        else:
            session = await self._create(owner, profile)
        if policy is not None:
            session.placeholders = placeholders
            try:
                await self._open_door(session, policy)
            except BaseException:
                self._remove(session, "lost")
                await self._close(session, "lost")
                raise
        return session.info()

    def _egress_for(self, asked: EgressAsk) -> Policy | None:
        if self.egress is None:
            if asked is not None:
                raise EgressRefused(
                    "this server gives sessions no egress (start it with --egress-policy)"
                )
            return None
        return self.egress.policy_for(asked)

    async def _open_door(self, session: Session, policy: Policy) -> None:
        """Open the session's door on the host, and its end in the sandbox (a silent cell:
        the proxy address on the sandbox's loopback and the proxy variables)."""
        assert self.egress is not None and session.kernel is not None
        sandbox = session.kernel.sandbox
        if sandbox.door_dir is None or sandbox.door_inside is None:
            raise EgressRefused("this session's sandbox has no door for egress")
        await self._close_door(session.id)
        session.placeholders = self.egress.placeholders(policy, session.placeholders)
        door = await self.egress.open_door(
            session.id,
            _owner_tag(session.owner_key),
            policy,
            sandbox.door_dir,
            session.placeholders,
        )
        self._doors[session.id] = door
        session.egress = policy
        inside = sandbox.door_inside
        args = (
            f"door={inside + '/door.sock'!r}, ca_bundle={inside + '/ca.pem'!r}, "
            f"env={session.placeholders!r}"
        )
        result = await session.kernel.execute(
            _OPEN_DOOR.format(args=args), timeout_s=DOOR_OPEN_TIMEOUT_S, silent=True
        )
        if result.status is not CellStatus.OK:
            why = result.error["evalue"] if result.error else result.message
            raise SandboxError(f"session {session.id}: its egress did not open: {why}")

    async def _create(self, owner: str | None, profile: str = "lean") -> Session:
        pool = await self._pool(profile)
        await self._room_for(1)
        self._creating += 1
        try:
            kernel = await pool.take()
        finally:
            self._creating -= 1
        return self._adopt(kernel, owner_key(owner), profile)

    def _adopt(
        self, kernel: KernelClient, key: str | None, profile: str, execution_count: int = 0
    ) -> Session:
        """A new session (new id) on a started kernel, with its record on disk."""
        session = Session(
            new_session_id(),
            kernel,
            key,
            self.config.max_queued_cells,
            profile=profile,
            freeze_idle_s=self.config.limits.freeze_idle_s,
            execution_count=execution_count,
            gate=self.gate,
        )
        session.waker = self._wake
        self._equip(session, kernel)
        self._sessions[session.id] = session
        self.store.save(self._record(session, RecordState.LIVE))
        self.created += 1
        self.observer.session_created(profile)
        log.info(
            "session start id=%s sandbox=%s profile=%s owner=%s",
            session.id,
            kernel.id,
            profile,
            _owner_tag(key),
        )
        return session

    def _paused_session(self, record: SessionRecord) -> Session:
        session = Session(
            record.id,
            None,
            record.owner_key,
            self.config.max_queued_cells,
            profile=record.profile,
            freeze_idle_s=self.config.limits.freeze_idle_s,
            created_at=record.created_at,
            last_active=record.last_active,
            execution_count=record.execution_count,
            gate=self.gate,
        )
        session.waker = self._wake
        session.egress = self._policy_again(record.egress, record.id)
        session.placeholders = _placeholders_of(record.egress)
        return session

    def _policy_again(self, described: dict[str, Any] | None, of: str) -> Policy | None:
        """A session's (or snapshot's) egress policy as recorded, under today's ceiling: one
        the ceiling no longer gives is dropped (no egress), and said so."""
        if described is None:
            return None
        asked = {k: v for k, v in described.items() if k != "placeholders"}
        try:
            if self.egress is None:
                raise EgressRefused("this server has no --egress-policy")
            return self.egress.policy_for(asked)
        except EgressRefused as exc:
            log.warning("session %s loses its egress %s: %s", of, described, exc)
            return None

    def _equip(self, session: Session, kernel: KernelClient) -> None:
        """Give a session's kernel what its cells reach through the channel: the LLM broker
        and package installs."""
        if self.llm is not None:
            from cloche.llm.bridge import KernelLLM

            kernel.llm = KernelLLM(self.llm, self.llm.budget(session.id), kernel)
        packages = self.installer.for_session(kernel.sandbox, self._runtime_of(session.profile))
        kernel.pip = KernelPip(packages, kernel)

    def _runtime_of(self, profile: str) -> Path | None:
        """The runtime a profile's sandboxes mount instead of the server's, if any."""
        pool = self.pools.get(profile)
        return pool.profile.runtime_dir if pool is not None else None

    def _record(self, session: Session, state: RecordState, origin: str = "") -> SessionRecord:
        info = session.info()
        return SessionRecord(
            id=session.id,
            owner_key=session.owner_key,
            profile=session.profile,
            created_at=info.created_at,
            last_active=info.last_active,
            execution_count=session.execution_count,
            state=state,
            egress=_egress_record(session),
            origin=origin,
        )

    @property
    def live_count(self) -> int:
        return len(self._sessions) - self.paused_count + self._creating

    @property
    def paused_count(self) -> int:
        return sum(1 for s in self._sessions.values() if s.paused)

    async def _room_for(self, count: int) -> None:
        """Make sure count more sessions may run: page out the least recently used idle
        sessions when the server is at --max-sessions and can save them.

        Raises:
            TooManySessions: it can't.
        """
        if self._stopped:
            raise TooManySessions("the server is shutting down")
        while self.live_count + count > self.config.max_sessions:
            idle = [
                s
                for s in self._sessions.values()
                if s.state is SessionState.IDLE and s.id not in self._pausing
            ]
            if not idle or self.limits.pause_idle_s <= 0 or not self.backend.can_checkpoint:
                raise TooManySessions(
                    f"the server already holds its maximum of {self.config.max_sessions} "
                    "sessions (--max-sessions); close some or raise the limit"
                )
            oldest = min(idle, key=lambda s: s.last_active)
            try:
                await self._pause(oldest, "room")
            except ClocheError as exc:
                raise TooManySessions(
                    f"the server holds its maximum of {self.config.max_sessions} sessions "
                    f"(--max-sessions) and could not page one out: {exc}"
                ) from exc

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

    async def sessions(self, owner: str | None = None) -> list[SessionInfo]:
        return self.list(owner)

    def get(self, session_id: str, owner: str | None = None) -> SessionInfo:
        """`info`, for code on the server's own loop (and tests)."""
        return self._find(session_id, owner).info()

    def session_ids(self) -> builtins.list[str]:
        """Every session held here, whoever owns it, paused ones too."""
        return builtins.list(self._sessions)

    def snapshot_ids(self) -> builtins.list[str]:
        return builtins.list(self._snapshots)

    def list(self, owner: str | None = None) -> list[SessionInfo]:
        """`sessions`, for code on the server's own loop (and tests)."""
        key = owner_key(owner)
        return [s.info() for s in self._sessions.values() if s.owner_key == key and s.usable]

    # -- running ------------------------------------------------------------------------

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
        stdin: bool = False,
        pager: bool = False,
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
                stdin=stdin,
                pager=pager,
            )
        except KernelDied as exc:
            self._forget(session, "lost")
            raise SessionNotFound(session_id) from exc
        self.observer.cell_finished(result, time.perf_counter() - started)
        if result.status is CellStatus.KILLED:
            self._forget(session, "killed")
        return result

    async def install_packages(
        self, session_id: str, specs: Sequence[str], owner: str | None = None
    ) -> InstalledPackages:
        session = self._find(session_id, owner)
        await session.wake()
        pip = session.kernel.pip if session.kernel is not None else None
        if pip is None:  # closed while it was being woken
            raise SessionNotFound(session_id)
        return await pip.install_through_cell(
            list(specs), lambda code: self.execute(session_id, code, owner=owner, silent=True)
        )

    async def interrupt(self, session_id: str, owner: str | None = None) -> bool:
        session = self._find(session_id, owner)
        await session.wake()
        return session.interrupt()

    async def restart(self, session_id: str, owner: str | None = None) -> SessionInfo:
        session = self._find(session_id, owner)
        await session.wake()
        fresh = await (await self._pool(session.profile)).take()
        old: list[KernelClient] = []

        async def swap(session: Session) -> None:
            kernel = session.detach()
            if kernel is not None:
                old.append(kernel)
                await asyncio.to_thread(carry_disk, kernel.sandbox, fresh.sandbox)
            session.attach(fresh)
            session.execution_count = 0
            self._equip(session, fresh)

        try:
            await session.hold(swap, interrupt=True)
        except KernelDied as exc:
            await fresh.close(why="the session it was for was closed")
            raise SessionNotFound(session_id) from exc
        finally:
            for kernel in old:  # the old interpreter, stopped as a closed session's is
                await kernel.close(why=f"session {session_id} was restarted")
        if session.egress is not None:  # a fresh interpreter: its end of the door again
            await self._open_door(session, session.egress)
        self.store.save(self._record(session, RecordState.LIVE))
        log.info("session restart id=%s sandbox=%s", session.id, fresh.id)
        return session.info()

    async def answer_input(self, session_id: str, value: str, owner: str | None = None) -> bool:
        session = self._find(session_id, owner)
        return session.kernel is not None and session.kernel.answer_input(value)

    async def files(self, session_id: str, owner: str | None = None) -> WorkdirFiles:
        """The working directory itself (blocking methods: call them in a thread)."""
        session = self._find(session_id, owner)
        await session.wake()
        if session.files is None:  # closed while it was being woken
            raise SessionNotFound(session_id)
        return session.files

    async def list_files(self, session_id: str, owner: str | None = None) -> FileListing:
        files = await self.files(session_id, owner)
        return await asyncio.to_thread(files.list)

    async def read_file(self, session_id: str, path: str, owner: str | None = None) -> bytes:
        files = await self.files(session_id, owner)
        return await asyncio.to_thread(files.read, path)

    async def write_files(
        self, session_id: str, files: Sequence[tuple[str, bytes]], owner: str | None = None
    ) -> None:
        workdir = await self.files(session_id, owner)

        def write_all() -> None:
            for path, data in files:
                workdir.write(path, data)

        await asyncio.to_thread(write_all)

    async def write_stream(
        self,
        session_id: str,
        path: str,
        chunks: AsyncIterable[bytes],
        owner: str | None = None,
    ) -> int:
        streamed = StreamedFile(await self.files(session_id, owner), normalise(path))
        await asyncio.to_thread(streamed.open)
        try:
            buffer = bytearray()
            async for chunk in chunks:
                buffer += chunk
                if len(buffer) >= STREAM_FLUSH_BYTES:
                    await asyncio.to_thread(streamed.write, bytes(buffer))
                    buffer.clear()
            await asyncio.to_thread(streamed.write, bytes(buffer))
            await asyncio.to_thread(streamed.finish)
        finally:
            await asyncio.to_thread(streamed.discard)
        return streamed.size

    # -- pausing and resuming -----------------------------------------------------------

    async def pause(self, session_id: str, owner: str | None = None) -> SessionInfo:
        session = self._find(session_id, owner)
        await self._pause(session, "request")
        return session.info()

    async def resume(self, session_id: str, owner: str | None = None) -> SessionInfo:
        session = self._find(session_id, owner)
        await session.wake()
        return session.info()

    async def _pause(self, session: Session, reason: str, *, interrupt: bool = False) -> None:
        """Save a session to disk and stop its sandbox, after its running cell (interrupted
        first if asked). Nothing if it is paused already.

        Raises:
            TooManyPausedSessions, StorageFull, CheckpointFailed: it runs on.
            SessionNotFound: it was closed or lost meanwhile.
        """

        async def save(session: Session) -> None:
            if self.paused_count >= self.config.max_paused_sessions:
                raise TooManyPausedSessions(
                    f"{self.config.max_paused_sessions} sessions are paused already "
                    "(--max-paused-sessions); close some or raise the limit"
                )
            assert session.kernel is not None
            started = time.perf_counter()
            home = self.store.session_dir(session.id)
            size = await self._checkpoint(session, home, keeps_running=False)
            self.store.save(
                self._record(session, RecordState.PAUSED, self._origin_of(session.profile))
            )
            kernel = session.detach()
            assert kernel is not None
            self._in_background(self._close_kernel(kernel, "paused"))
            self.observer.session_paused(reason, size)
            log.info(
                "session paused id=%s reason=%s bytes=%d ms=%.1f",
                session.id,
                reason,
                size,
                (time.perf_counter() - started) * 1000,
            )

        try:
            await session.hold(save, interrupt=interrupt)
        except KernelDied as exc:
            self._forget(session, "lost")
            raise SessionNotFound(session.id) from exc

    async def _wake(self, session: Session) -> None:
        """Restore a paused session's image into a new sandbox (its life is locked)."""
        if (moving := self._moving.get(session.id)) is not None:
            await moving.wait()  # the move ends: here again, or gone to another node
            if session.id in self._moved:
                raise SessionMoved(session.id)
        await self._room_for(1)
        home = self.store.session_dir(session.id)
        started = time.perf_counter()
        self._creating += 1
        try:
            record = await asyncio.to_thread(self._session_record, session.id)
            limits, runtime = await self._setup_of(session.profile)
            kernel = await self.checkpoints.restore(
                home, origin=record.origin, reseed=False, limits=limits, runtime=runtime
            )
        except RestoreRefused as exc:
            self.observer.resume_failed()
            why = f"because it could not be resumed: {exc}"
            log.error("session broken id=%s: %s", session.id, exc)
            self._lost[session.id] = (session.owner_key, why, session.created_at)
            self._remove(session, "broken")
            session.state = SessionState.CLOSED
            await asyncio.to_thread(self._bury, session)
            raise SessionLost(session.id, why) from exc
        finally:
            self._creating -= 1
        self._equip(session, kernel)
        session.attach(kernel)
        if session.egress is not None:
            await self._open_door(session, session.egress)
        self.store.save(self._record(session, RecordState.LIVE))
        await asyncio.to_thread(self.checkpoints.discard, home)
        seconds = time.perf_counter() - started
        self.observer.session_resumed(seconds)
        log.info("session resumed id=%s ms=%.1f", session.id, seconds * 1000)

    def _session_record(self, session_id: str) -> SessionRecord:
        """A session's record on disk (blocking). Raises RestoreRefused when it is gone."""
        try:
            return self.store.session_record(session_id)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise RestoreRefused(f"session {session_id} has no readable record: {exc}") from exc

    def _bury(self, session: Session) -> None:
        """A session that can't come back: its image goes, its record says lost (blocking)."""
        self.checkpoints.discard(self.store.session_dir(session.id))
        self.store.save(self._record(session, RecordState.LOST))

    # -- snapshots and forks --------------------------------------------------------------

    async def snapshot(
        self, session_id: str, owner: str | None = None, name: str = ""
    ) -> SnapshotRecord:
        session = self._find(session_id, owner)
        snapshot_id = new_session_id()
        home = self.store.snapshot_dir(snapshot_id)

        async def save(session: Session) -> None:
            if session.paused:  # its image is on disk already: copy it
                self.store.reserve(0)
                size = await asyncio.to_thread(
                    self.checkpoints.copy_image, self.store.session_dir(session.id), home
                )
                origin = (await asyncio.to_thread(self._session_record, session.id)).origin
            else:
                size = await self._checkpoint(session, home, keeps_running=True)
                origin = self._origin_of(session.profile)
            record = SnapshotRecord(
                id=snapshot_id,
                session_id=session.id,
                name=name,
                owner_key=session.owner_key,
                profile=session.profile,
                created_at=time.time(),
                execution_count=session.execution_count,
                size_bytes=size,
                origin=origin,
                egress=_egress_record(session),
            )
            self.store.save(record)
            self._snapshots[snapshot_id] = record

        try:
            await session.hold(save, paused_too=True)
        except KernelDied as exc:
            self._forget(session, "lost")
            raise SessionNotFound(session_id) from exc
        except BaseException:
            await asyncio.to_thread(self.store.remove, home)
            raise
        record = self._snapshots[snapshot_id]
        self.observer.snapshot_taken(record.size_bytes)
        log.info("snapshot id=%s session=%s bytes=%d", snapshot_id, session_id, record.size_bytes)
        return record

    async def snapshots(self, owner: str | None = None) -> builtins.list[SnapshotRecord]:
        key = owner_key(owner)
        found = [r for r in self._snapshots.values() if r.owner_key == key]
        return sorted(found, key=lambda r: r.created_at)

    async def get_snapshot(self, snapshot_id: str, owner: str | None = None) -> SnapshotRecord:
        return self._snapshot(snapshot_id, owner)

    def _snapshot(self, snapshot_id: str, owner: str | None = None) -> SnapshotRecord:
        record = self._snapshots.get(snapshot_id)
        if record is None or record.owner_key != owner_key(owner):
            raise SnapshotNotFound(snapshot_id)
        return record

    async def delete_snapshot(self, snapshot_id: str, owner: str | None = None) -> None:
        self._snapshot(snapshot_id, owner)
        del self._snapshots[snapshot_id]
        await asyncio.to_thread(self.store.remove, self.store.snapshot_dir(snapshot_id))
        log.info("snapshot deleted id=%s", snapshot_id)

    async def _from_snapshot(self, snapshot_id: str, owner: str | None) -> Session:
        record = self._snapshot(snapshot_id, owner)
        await self._room_for(1)
        started = time.perf_counter()
        kernel = await self._restore(
            self.store.snapshot_dir(snapshot_id), record.origin, record.profile
        )
        self.observer.snapshot_restored(time.perf_counter() - started)
        return self._adopt(kernel, record.owner_key, record.profile, record.execution_count)

    async def _restore(self, home: Path, origin: str, profile: str) -> KernelClient:
        """A kernel of profile restored (reseeded) from an image, counted as being created."""
        self._creating += 1
        try:
            limits, runtime = await self._setup_of(profile)
            async with self._restores:
                return await self.checkpoints.restore(
                    home, origin=origin, reseed=True, limits=limits, runtime=runtime
                )
        finally:
            self._creating -= 1

    def _origin_of(self, profile: str) -> str:
        return self.checkpoints.origin(self._runtime_of(profile))

    async def _setup_of(self, profile: str) -> tuple[Limits, Path | None]:
        """The limits and runtime of a profile's sandboxes (one of the file waits for its
        runtime to be built).

        Raises:
            RestoreRefused: the profile is not served here (any more).
        """
        try:
            pool = await self._pool(profile)
        except (UnknownProfile, SandboxStartError) as exc:
            raise RestoreRefused(f"the image is of profile {profile!r}: {exc}") from exc
        return pool.limits, pool.profile.runtime_dir

    async def fork(
        self, session_id: str, count: int = 1, owner: str | None = None
    ) -> builtins.list[SessionInfo]:
        session = self._find(session_id, owner)
        if not 1 <= count <= self.config.max_fork:
            raise ForkRefused(
                f"a fork makes 1 to {self.config.max_fork} copies (--max-fork), not {count}"
            )
        await self._room_for(count)
        home = self.store.root / "forks" / new_session_id()
        origin = self._origin_of(session.profile)

        async def save(session: Session) -> None:
            nonlocal origin
            home.parent.mkdir(mode=0o700, exist_ok=True)
            if session.paused:
                await asyncio.to_thread(
                    self.checkpoints.copy_image, self.store.session_dir(session.id), home
                )
                origin = (await asyncio.to_thread(self._session_record, session.id)).origin
            else:
                size = await self._checkpoint(session, home, keeps_running=True)
                self.observer.fork_image_saved(size)

        made: list[Session] = []
        try:
            try:
                await session.hold(save, paused_too=True)
            except KernelDied as exc:
                self._forget(session, "lost")
                raise SessionNotFound(session_id) from exc
            started = time.perf_counter()
            kernels = await asyncio.gather(
                *(self._restore(home, origin, session.profile) for _ in range(count)),
                return_exceptions=True,
            )
            for kernel in kernels:
                if isinstance(kernel, KernelClient):
                    made.append(
                        self._adopt(
                            kernel, session.owner_key, session.profile, session.execution_count
                        )
                    )
            failed = [k for k in kernels if isinstance(k, BaseException)]
            if failed:
                raise failed[0]
            if session.egress is not None:  # each copy gets a door of its own
                for copy in made:
                    copy.placeholders = dict(session.placeholders)
                    await self._open_door(copy, session.egress)
            self.observer.forked(count, time.perf_counter() - started)
            log.info("fork session=%s copies=%s", session_id, ",".join(s.id for s in made))
            return [s.info() for s in made]
        except BaseException:
            for copy in made:
                self._forget(copy, "failed-fork")
            raise
        finally:
            await asyncio.to_thread(self.store.remove, home)

    # -- closing ------------------------------------------------------------------------

    # -- moving to another node (cluster drain) ---------------------------------------------

    async def export_session(self, session_id: str) -> tuple[SessionRecord, bytes]:
        """Pause a session and hand out its record and image, for another node to adopt.
        It stays here, paused, and its requests wait, until `release_session`.

        Raises:
            SessionNotFound, CheckpointFailed, StorageFull: it stays here as it was.
        """
        session = self._sessions.get(session_id)  # whoever owns it: the cluster moves it
        if session is None or not session.usable:
            raise SessionNotFound(session_id)
        self._moving[session_id] = asyncio.Event()
        try:
            for _ in range(3):  # a cell queued before the move may wake it once more
                await self._pause(session, "move")
                if session.state is SessionState.PAUSED:
                    break
            else:
                raise CheckpointFailed(f"session {session_id} kept being woken")
            record = await asyncio.to_thread(self._session_record, session_id)
            image = await asyncio.to_thread(pack_home, self.store.session_dir(session_id))
        except BaseException:
            self._moving.pop(session_id).set()
            raise
        return record, image

    async def release_session(self, session_id: str, *, moved: bool) -> None:
        """End a move: the session now lives on another node (moved) or goes on here."""
        if moved:
            self._moved.add(session_id)
            session = self._sessions.pop(session_id, None)
            if session is not None:
                session.state = SessionState.CLOSED
                self.closed_by_reason["moved"] += 1
            await asyncio.to_thread(self.store.remove, self.store.session_dir(session_id))
        if (moving := self._moving.pop(session_id, None)) is not None:
            moving.set()

    async def adopt_session(self, record: SessionRecord, image: bytes) -> None:
        """Take in a paused session moved from another node; it resumes on its next request."""
        home = self.store.session_dir(record.id)
        await asyncio.to_thread(unpack_home, image, home)
        self.store.save(replace(record, state=RecordState.PAUSED))
        self.store.added(home)
        self._moved.discard(record.id)
        self._sessions[record.id] = self._paused_session(record)

    async def export_snapshot(self, snapshot_id: str) -> tuple[SnapshotRecord, bytes]:
        """A snapshot's record and image, for another node to adopt (it stays here too)."""
        record = self._snapshots.get(snapshot_id)
        if record is None:
            raise SnapshotNotFound(snapshot_id)
        image = await asyncio.to_thread(pack_home, self.store.snapshot_dir(snapshot_id))
        return record, image

    async def adopt_snapshot(self, record: SnapshotRecord, image: bytes) -> None:
        if record.id in self._snapshots:
            return
        home = self.store.snapshot_dir(record.id)
        await asyncio.to_thread(unpack_home, image, home)
        self.store.added(home)
        self._snapshots[record.id] = record

    async def close(
        self, session_id: str, owner: str | None = None, reason: str = "closed"
    ) -> None:
        session = self._find(session_id, owner)
        self._remove(session, reason)
        await self._close(session, reason)

    def _remove(self, session: Session, reason: str) -> None:
        del self._sessions[session.id]
        self.closed_by_reason[reason] += 1
        self.observer.session_closed(reason)
        if reason in _EXPIRED:
            self.ended_seq += 1
            self._ended.append((self.ended_seq, session.id))

    def ended_since(self, seq: int) -> builtins.list[str]:
        """Sessions that ended here on their own (idle timeout, lifetime) after the
        `ended_seq` seq, oldest first (the last ENDED_KEPT): a cluster's directory forgets
        them, as it forgets those a front end closed."""
        return [session_id for number, session_id in self._ended if number > seq]

    async def _checkpoint(self, session: Session, home: Path, *, keeps_running: bool) -> int:
        """Save a running session's image into home (its size). A session with egress has
        its door closed and its connections ended first (gVisor cannot save a socket
        connected to the host); the door opens again if the sandbox runs on."""
        assert session.kernel is not None
        policy = session.egress
        if policy is not None:
            await self._close_door(session.id)
            ended = await session.kernel.execute(
                _DROP_CONNECTIONS, timeout_s=DOOR_OPEN_TIMEOUT_S, silent=True
            )
            if ended.status is not CellStatus.OK:
                why = ended.error["evalue"] if ended.error else ended.message
                await self._open_door(session, policy)
                raise CheckpointFailed(f"its egress connections did not end: {why}")
        try:
            size = await self.checkpoints.save(session.kernel, home)
        except BaseException:
            if policy is not None and session.kernel is not None and session.kernel.alive:
                await self._open_door(session, policy)
            raise
        if policy is not None and keeps_running:
            await self._open_door(session, policy)
        return size

    async def _close_door(self, session_id: str) -> None:
        door = self._doors.pop(session_id, None)
        if door is not None:
            await door.close()

    async def _close(self, session: Session, reason: str) -> None:
        await self._close_door(session.id)
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

    def _page_out(self, session: Session) -> None:
        """Pause an idle session in the background (a few at a time)."""

        async def page_out() -> None:
            try:
                async with self._page_outs:
                    if session.state is SessionState.IDLE and not self._stopped:
                        await self._pause(session, "idle")
            except ClocheError as exc:
                log.warning("session %s not paused: %s", session.id, exc)
            finally:
                self._pausing.pop(session.id, None)

        self._pausing[session.id] = asyncio.create_task(page_out())

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
                idle_s = now - session.last_active
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

    async def stop(self) -> None:
        """Pause every live session to disk (a few at a time; running cells interrupted
        first), then free every sandbox. A session that can't be saved is closed."""
        self._stopped = True
        if self.catalog is not None:
            await self.catalog.stop()
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        await asyncio.gather(*self._pausing.values(), return_exceptions=True)
        live = [s for s in self._sessions.values() if not s.paused]
        limit = asyncio.Semaphore(self.config.pause_concurrency)

        async def keep(session: Session) -> None:
            async with limit:
                try:
                    if self.backend.can_checkpoint:
                        await self._pause(session, "shutdown", interrupt=True)
                        return
                except ClocheError as exc:
                    log.error("session %s could not be paused at shutdown: %s", session.id, exc)
                if self._sessions.get(session.id) is session:
                    self._remove(session, "shutdown")
                    await self._close(session, "shutdown")

        await asyncio.gather(
            *(pool.close() for pool in self.pools.values()),
            *(keep(s) for s in live),
            return_exceptions=True,
        )
        await asyncio.gather(*self._closing, return_exceptions=True)
        await asyncio.gather(*(door.close() for door in self._doors.values()))
        self._doors.clear()
        await asyncio.to_thread(self.backend.shutdown)
        self.store.close()
        if self.llm is not None:
            await self.llm.close()

    @property
    def session_count(self) -> int:
        return len(self._sessions) - self.paused_count


def _placeholders_of(described: dict[str, Any] | None) -> dict[str, str]:
    kept = (described or {}).get("placeholders") or {}
    return {str(k): str(v) for k, v in kept.items()} if isinstance(kept, dict) else {}


def _egress_record(session: Session) -> dict[str, Any] | None:
    """A session's egress as its record keeps it: the policy asked for, and its secrets'
    placeholders (which are in its memory: a copy or a restore goes on with them)."""
    if session.egress is None:
        return None
    return {**session.egress.describe(), "placeholders": dict(session.placeholders)}


def _owner_tag(key: str | None) -> str:
    """A short, non-secret tag for a token in logs."""
    return "-" if key is None else key[:8]
