"""A session: one kernel, its cells in FIFO order, and its lifecycle."""

from __future__ import annotations

import asyncio
import enum
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cloche.config import MIB
from cloche.errors import KernelDied, SessionBusy
from cloche.sandbox.base import ExitStep
from cloche.sandbox.files import WorkdirFiles
from cloche.sandbox.listing import Snapshot, changed
from cloche.sessions.cpu import CpuPlacement
from cloche.sessions.gate import CellGate
from cloche.sessions.history import DEFAULT_HISTORY_CELLS, History
from cloche.sessions.kernel import EventCallback, KernelClient
from cloche.sessions.result import CellResult, CellStatus
from cloche.volumes.paths import VolumeMount

if TYPE_CHECKING:
    from cloche.network.egress.policy import Policy

# A working directory this small is walked on the event loop: ~1 µs an entry.
_INLINE_WALK_ENTRIES = 64
# Before an idle session is frozen, its sandbox's CPU use is watched for this long: one
# busy with work of its own (a background thread, a subprocess) is left running. An idle
# runsc sandbox uses 2-3% of a core; more than BUSY_SHARE of one counts as busy.
FREEZE_PROBE_S = 1.0
BUSY_SHARE = 0.10

log = logging.getLogger("cloche.session")
# Cells whose end is the user's business: logged at debug level (see `Session.execute`).
_ROUTINE = frozenset({CellStatus.OK, CellStatus.ERROR})


class SessionState(enum.Enum):
    """Where a session is in its life."""

    IDLE = "idle"  # alive, no cell running
    BUSY = "busy"  # a cell is running (more may be queued)
    PAUSED = "paused"  # saved to disk, no sandbox; its next request brings it back
    CLOSING = "closing"  # being torn down; takes no more cells
    CLOSED = "closed"  # gone: its sandbox is freed


def owner_key(owner: str | None) -> str | None:
    """How sessions know their owner: a hash of the token (records on disk hold no token)."""
    return None if owner is None else hashlib.sha256(owner.encode()).hexdigest()


@dataclass(frozen=True)
class SessionInfo:
    """What can be told about a session without touching it."""

    id: str
    owner_key: str | None
    state: SessionState
    created_at: float  # unix time, s
    last_active: float  # unix time, s
    execution_count: int
    queued_cells: int
    profile: str
    egress: dict[str, Any] | None = None  # the policy it was given ({policy, allow?}), if any
    template: str = "python"  # the template its system is made of
    metadata: dict[str, str] = field(default_factory=dict)  # its owner's labels
    cell_timeout_s: float | None = None  # its cells' default time limit, if it has its own
    # What its sandbox has used, when asked for (listings): CPU time, s; memory now, bytes.
    cpu_s: float | None = None
    memory_bytes: int | None = None
    last_cell: dict[str, Any] | None = None  # {number, end_reason, ended_at} of its last cell
    volumes: list[dict[str, Any]] = field(default_factory=list)  # {name, path, read_only} each


class Session:
    """A live kernel that keeps its state between cells; cells run one at a time."""

    def __init__(
        self,
        session_id: str,
        kernel: KernelClient | None,
        owner_key: str | None,
        max_queued: int,
        *,
        profile: str = "lean",
        freeze_idle_s: float = 0.0,
        created_at: float | None = None,
        last_active: float | None = None,
        execution_count: int = 0,
        gate: CellGate | None = None,
    ) -> None:
        self.id = session_id
        self.gate = gate
        self.egress: Policy | None = None  # what it may reach (a door is opened for it)
        self.placeholders: dict[str, str] = {}  # its secrets' placeholders, by secret name
        # Where its sandbox stands for the CPU while its cells take turns at the gate
        self.cpu = CpuPlacement(session_id, gate, lambda: self.kernel) if gate is not None else None
        self.profile = profile
        self.template = "python"  # the template its system is made of
        self.env: dict[str, str] = {}  # asked at its creation: its commands get it too
        self.volumes: list[VolumeMount] = []  # what it mounts, again in every sandbox it runs on
        self.in_use = 0  # commands and terminals being watched: it is not idle meanwhile
        self.owner_key = owner_key
        self.kernel: KernelClient | None = None
        self.files: WorkdirFiles | None = None  # its working directory, while it runs
        self.state = SessionState.PAUSED
        self.created_at = time.time() if created_at is None else created_at
        self._last_active_wall = self.created_at if last_active is None else last_active
        # monotonic time of the last activity, carried over from a record's wall time
        self.last_active = time.monotonic() - max(0.0, time.time() - self._last_active_wall)
        self.execution_count = execution_count
        self.close_reason: str | None = None
        self.metadata: dict[str, str] = {}  # its owner's labels (operations.md)
        self.cell_timeout_s: float | None = None  # its cells' default limit, if its own
        self.history = History(DEFAULT_HISTORY_CELLS)  # its last cells (the manager's size)
        self._max_queued = max_queued
        self._lock = asyncio.Lock()  # asyncio.Lock wakes waiters in FIFO order
        self._life = asyncio.Lock()  # held while the session is paused or resumed
        self._waiting = 0
        self._freeze_idle_s = freeze_idle_s
        self._freeze_timer: asyncio.TimerHandle | None = None
        # Brings a paused session back (the manager's): restores its image, then `attach`.
        self.waker: Callable[[Session], Awaitable[None]] | None = None
        if kernel is not None:
            self.attach(kernel)

    def attach(self, kernel: KernelClient) -> None:
        """Run on kernel from now on (a new session's, or a paused one's restored)."""
        sandbox = kernel.sandbox
        if self.cpu is not None:
            self.cpu.behind = False  # a new sandbox starts level with the others
        uid, gid = sandbox.file_owner or (None, None)
        self.files = WorkdirFiles(sandbox.workdir, uid, gid, sandbox.limits.disk_mib * MIB)
        self.kernel = kernel
        self.state = SessionState.IDLE
        self.idle_from_now()

    def detach(self) -> KernelClient | None:
        """The session is saved: it goes on without a sandbox. Returns the kernel to close."""
        kernel, self.kernel, self.files = self.kernel, None, None
        self._cancel_freeze()
        self.state = SessionState.PAUSED
        return kernel

    def info(self, usage: bool = False) -> SessionInfo:
        """What can be told of it; with usage, what its sandbox has used too (two reads of
        its cgroup: for listings, not for every cell)."""
        sandbox = self.kernel.sandbox if usage and self.kernel is not None else None
        return SessionInfo(
            id=self.id,
            owner_key=self.owner_key,
            state=self.state,
            created_at=self.created_at,
            last_active=self._last_active_wall,
            execution_count=self.execution_count,
            queued_cells=self._waiting,
            profile=self.profile,
            egress=self.egress.describe() if self.egress is not None else None,
            template=self.template,
            metadata=dict(self.metadata),
            cell_timeout_s=self.cell_timeout_s,
            last_cell=_last_cell(self.history),
            cpu_s=sandbox.cpu_seconds() if sandbox is not None else None,
            memory_bytes=sandbox.memory_bytes() if sandbox is not None else None,
            volumes=[m.to_json() for m in self.volumes],
        )

    @property
    def usable(self) -> bool:
        if self.state is SessionState.PAUSED:
            return True
        return (
            self.state in (SessionState.IDLE, SessionState.BUSY)
            and self.kernel is not None
            and self.kernel.alive
        )

    @property
    def paused(self) -> bool:
        return self.state is SessionState.PAUSED

    async def wake(self) -> None:
        """Bring a paused session back (once, whoever asks first); nothing if it runs.

        Raises:
            SessionLost, TooManySessions, ...: what the waker raises.
        """
        if self.state is not SessionState.PAUSED and not self._life.locked():
            return
        # A wake under way may have attached its kernel and still be setting it up (its
        # egress door is a silent cell): a cell waits for it rather than run beside it.
        async with self._life:
            if self.state is SessionState.PAUSED:
                assert self.waker is not None
                await self.waker(self)

    async def hold(
        self,
        action: Callable[[Session], Awaitable[None]],
        *,
        interrupt: bool = False,
        paused_too: bool = False,
    ) -> bool:
        """Run action between cells (after the running one, which interrupt stops first),
        with the session's life locked: nothing pauses or resumes it meanwhile. Not for a
        paused session unless paused_too; False when it was skipped so.

        Raises:
            KernelDied: the session was closed or lost meanwhile.
        """
        if interrupt and self.kernel is not None:
            self.kernel.interrupt()
        await self._lock.acquire()
        try:
            async with self._life:
                if self.state is SessionState.PAUSED and not paused_too:
                    return False
                if not self.usable:
                    raise KernelDied(self.close_reason or "session closed")
                await action(self)
                return True
        finally:
            self._lock.release()

    async def execute(
        self,
        code: str,
        *,
        timeout_s: float,
        on_event: EventCallback | None = None,
        track_files: bool = False,
        silent: bool = False,
        stdin: bool = False,
        pager: bool = False,
        accepted: asyncio.Event | None = None,
    ) -> CellResult:
        """Queue a cell behind the running one and run it (with stdin, its input() asks
        on_event; with pager, `obj?` goes to on_event: see `KernelClient.execute`).
        `accepted` is set once it is queued (not refused as busy).

        Raises:
            SessionBusy: max_queued cells are already waiting.
            KernelDied: the session was closed or its sandbox lost before the cell ran.
        """
        if self._lock.locked() and self._waiting >= self._max_queued:
            raise SessionBusy(
                f"session {self.id} already has {self._waiting} cells waiting "
                f"(limit {self._max_queued}); wait for them to finish"
            )
        self._waiting += 1
        if accepted is not None:
            accepted.set()
        queued = time.perf_counter()
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        waited_s = time.perf_counter() - queued
        try:
            await self.wake()
            if not self.usable or self.kernel is None:
                death = self.kernel.death if self.kernel is not None else None
                raise KernelDied(self.close_reason or death or "session closed")
            self._cancel_freeze()
            self.state = SessionState.BUSY
            started = time.perf_counter()
            before = await self._snapshot() if track_files else None
            run = functools.partial(
                self.kernel.execute,
                code,
                timeout_s=timeout_s,
                on_event=on_event,
                silent=silent,
                stdin=stdin,
                pager=pager,
            )
            if self.cpu is None:
                result = await run()
            else:
                result = await self.cpu.take_turn(self.kernel, run)
                waited_s += result.queue_wait_s
            result.queue_wait_s = waited_s
            if before is not None and result.session_survived:
                result.files = changed(before, await self._snapshot())
            self.execution_count = result.execution_count or self.execution_count
            # One line per cell would cost a busy server ~10% of its CPU (BENCHMARKS.md,
            # "Many busy sessions"), and /metrics counts cells: cells that ran or raised
            # are logged at debug level, those stopped by a limit or lost at info.
            log.log(
                logging.DEBUG if result.status in _ROUTINE else logging.INFO,
                "cell session=%s status=%s duration_ms=%.2f count=%d",
                self.id,
                result.status.value,
                (time.perf_counter() - started) * 1000,
                result.execution_count,
            )
            return result
        finally:
            self.touch()
            if self.state is SessionState.BUSY:
                self.state = SessionState.IDLE
            self._lock.release()
            self.idle_from_now()

    async def _snapshot(self) -> Snapshot:
        """The working directory's files; walked right here when the last walk saw only a
        few entries (a thread's hand-off would cost more), else in a thread."""
        assert self.files is not None
        if self.files.last_walk_entries <= _INLINE_WALK_ENTRIES:
            return self.files.snapshot()
        return await asyncio.to_thread(self.files.snapshot)

    def idle_from_now(self) -> None:
        """(Re)start the clock after which an idle session's sandbox is frozen."""
        if self._freeze_idle_s <= 0 or self.kernel is None:
            return
        self._cancel_freeze()
        self._freeze_timer = asyncio.get_running_loop().call_later(
            self._freeze_idle_s, self._freeze_if_idle
        )

    def _cancel_freeze(self) -> None:
        if self._freeze_timer is not None:
            self._freeze_timer.cancel()
            self._freeze_timer = None

    @property
    def _idle(self) -> bool:
        return (
            self.state is SessionState.IDLE
            and not self._lock.locked()
            and self.usable
            and not self.in_use
            and not self._asking
        )

    @property
    def _asking(self) -> bool:
        """Whether its process supervisor owes an answer (a file operation, a command's
        start or signal): frozen meanwhile, it would answer nothing until the next cell."""
        return self.kernel is not None and self.kernel.processes.asking

    def _freeze_if_idle(self) -> None:
        """The idle period is over: watch the sandbox's CPU use for FREEZE_PROBE_S."""
        self._freeze_timer = None
        if self._asking:  # an answer's arrival restarts no clock: look again a period later
            self.idle_from_now()
            return
        if not self._idle or self.kernel is None:
            return
        used = self.kernel.sandbox.cpu_seconds()
        loop = asyncio.get_running_loop()
        if used is None:  # no accounting: nothing to tell idle from busy by
            self._freeze_if_quiet(None, loop.time())
        else:
            self._freeze_timer = loop.call_later(
                FREEZE_PROBE_S, self._freeze_if_quiet, used, loop.time()
            )

    def _freeze_if_quiet(self, used_before: float | None, since: float) -> None:
        self._freeze_timer = None
        if not self._idle or self.kernel is None:
            return
        sandbox = self.kernel.sandbox
        used = sandbox.cpu_seconds()
        elapsed = asyncio.get_running_loop().time() - since
        if used_before is not None and used is not None and elapsed > 0:
            if (used - used_before) / elapsed > BUSY_SHARE:
                self.idle_from_now()  # working on its own: look again a period later
                return
        sandbox.freeze()  # thawed by the next cell, interrupt or close

    def touch(self) -> None:
        self.last_active = time.monotonic()
        self._last_active_wall = time.time()

    def interrupt(self) -> bool:
        """Interrupt the running cell, if there is one."""
        return self.kernel is not None and self.kernel.interrupt()

    async def close(self, reason: str) -> ExitStep:
        """Tear the session down (idempotent). Queued cells fail with KernelDied."""
        if self.state is SessionState.CLOSED:
            return ExitStep.EXITED
        if self.close_reason is None:
            self.close_reason = f"session {self.id} was closed ({reason})"
        self.state = SessionState.CLOSING
        self._cancel_freeze()
        kernel, self.kernel = self.kernel, None
        if kernel is None:
            self.state = SessionState.CLOSED
            return ExitStep.EXITED
        kernel.interrupt()
        step = await kernel.close(why=self.close_reason)
        self.state = SessionState.CLOSED
        return step

    @property
    def dead(self) -> bool:
        """Its sandbox is gone (killed, crashed) while idle, and nobody closed it yet."""
        return self.state is SessionState.IDLE and self.kernel is not None and not self.kernel.alive


def _last_cell(history: History) -> dict[str, Any] | None:
    last = history.last
    if last is None:
        return None
    return {"number": last.number, "end_reason": last.end_reason, "ended_at": last.ended_at}
