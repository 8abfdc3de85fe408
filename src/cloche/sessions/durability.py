"""The verbs that save a session of one machine: pause, resume, restart, and paging idle
sessions out to make room; and the checkpoint and restore that copies use too.

The fourth layer of `LocalSessionManager` (`sessions.local`), over `sessions.running`'s
live sessions; copies (snapshots, forks) are the next layer's (`sessions.copies`). The
durable form itself (runsc checkpoint and restore of one kernel, the images on disk) is
`sessions.durable`'s.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cloche.config import Limits
from cloche.errors import (
    CheckpointFailed,
    ClocheError,
    KernelDied,
    RestoreRefused,
    SandboxStartError,
    SessionError,
    SessionLost,
    SessionMoved,
    SessionNotFound,
    TooManyPausedSessions,
    TooManySessions,
)
from cloche.sandbox.base import SandboxSetup
from cloche.sandbox.layers import System
from cloche.sessions.computers import ComputerSessions
from cloche.sessions.doors import placeholders_of
from cloche.sessions.durable import pack_disk
from cloche.sessions.history import History
from cloche.sessions.kernel import KernelClient
from cloche.sessions.profiles import PYTHON
from cloche.sessions.session import Session, SessionInfo, SessionState
from cloche.sessions.store import RecordState, SessionRecord
from cloche.volumes.paths import VolumeMount

if TYPE_CHECKING:
    pass

log = logging.getLogger("cloche.session")


class DurableSessions(ComputerSessions):
    """Live sessions that can also be saved to disk and brought back."""

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
        session.egress = self.doors.policy_again(record.egress, record.id)
        session.placeholders = placeholders_of(record.egress)
        session.metadata = dict(record.metadata)
        session.cell_timeout_s = record.cell_timeout_s
        session.template = record.template
        session.env = dict(record.env)
        session.volumes = [VolumeMount(**v) for v in record.volumes]
        session.history = History.load(self.store.session_dir(record.id), self.config.history_cells)
        return session

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

    async def restart(self, session_id: str, owner: str | None = None) -> SessionInfo:
        session = self._find(session_id, owner)
        await session.wake()
        pool = await self._pool(session.profile, session.template)
        old: list[KernelClient] = []
        fresh: list[KernelClient] = []

        async def swap(session: Session) -> None:
            kernel = session.detach()
            if kernel is None:
                raise KernelDied(f"session {session_id} has no sandbox")
            old.append(kernel)
            # A fresh interpreter on the same disk: files, packages and system layer stay.
            with tempfile.TemporaryDirectory(dir=self.store.root) as scratch:
                disk = Path(scratch) / "disk.tar"
                await asyncio.to_thread(pack_disk, kernel.sandbox.disk, disk)
                await kernel.close(why=f"session {session_id} was restarted")
                setup = self._volume_setup(session.owner_key, session.volumes)
                fresh.append(await pool.start_on(disk, setup))
            session.attach(fresh[0])
            session.execution_count = 0
            if session.env:
                await self._set_env(fresh[0], session.env)
            self._equip(session, fresh[0])

        try:
            await session.hold(swap, interrupt=True)
        except KernelDied as exc:
            for kernel in fresh:
                await kernel.close(why="the session it was for was closed")
            raise SessionNotFound(session_id) from exc
        finally:
            for kernel in old:  # the old interpreter, stopped as a closed session's is
                await kernel.close(why=f"session {session_id} was restarted")
        if session.egress is not None:  # a fresh interpreter: its end of the door again
            await self.doors.open(session, session.egress)
        self.store.save(self._record(session, RecordState.LIVE))
        log.info("session restart id=%s sandbox=%s", session.id, fresh[0].id)
        return session.info()

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
            # At shutdown the image is written uncompressed: the next start resumes it at
            # once (--resume-at-start), and such an image restores faster. A compressed
            # one is written instead when the uncompressed one has no room.
            quick = reason == "shutdown" and self.config.resume_at_start
            try:
                size = await self._checkpoint(
                    session, home, keeps_running=False, compressed=not quick
                )
            except CheckpointFailed as exc:  # StorageFull too: it has no room uncompressed
                if not quick:
                    raise
                log.warning(
                    "session %s: its uncompressed image failed (%s); compressed", session.id, exc
                )
                size = await self._checkpoint(session, home, keeps_running=False)
            await asyncio.to_thread(session.history.save, home)
            origin = self._origin_of(session.profile)
            self.store.save(self._record(session, RecordState.PAUSED, origin, reason))
            kernel = session.detach()
            assert kernel is not None
            kernel.processes.lost("the session was paused", suspended=True)
            self._in_background(self._close_kernel(kernel, "paused"))
            self.observer.session_paused(reason, size)
            self._tell("session.paused", session, {"reason": reason, "image_bytes": size})
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
            limits, runtime, system = await self._setup_of(session.profile, session.template)
            kernel = await self.checkpoints.restore(
                home,
                origin=record.origin,
                reseed=False,
                limits=limits,
                runtime=runtime,
                system=system,
                setup=self._volume_setup(session.owner_key, session.volumes),
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
            await self.doors.open(session, session.egress)
        await self._follow_running(session)
        self.store.save(self._record(session, RecordState.LIVE))
        await asyncio.to_thread(self.checkpoints.discard, home)
        seconds = time.perf_counter() - started
        self.observer.session_resumed(seconds)
        self._tell("session.resumed", session, {"seconds": round(seconds, 3)})
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

    async def _restore(
        self,
        home: Path,
        origin: str,
        profile: str,
        template: str = PYTHON,
        setup: SandboxSetup | None = None,
    ) -> KernelClient:
        """A kernel of profile and template restored (reseeded) from an image, counted as
        being created (its sandbox set up first: its volumes bound)."""
        self._creating += 1
        try:
            limits, runtime, system = await self._setup_of(profile, template)
            async with self._restores:
                return await self.checkpoints.restore(
                    home,
                    origin=origin,
                    reseed=True,
                    limits=limits,
                    runtime=runtime,
                    system=system,
                    setup=setup,
                )
        finally:
            self._creating -= 1

    def _origin_of(self, profile: str) -> str:
        return self.checkpoints.origin(self._runtime_of(profile))

    async def _setup_of(
        self, profile: str, template: str = PYTHON
    ) -> tuple[Limits, Path | None, System | None]:
        """The limits, runtime and system of a profile's sandboxes of a template (a profile
        of the file waits for its runtime to be built).

        Raises:
            RestoreRefused: the profile or the template is not served here (any more).
        """
        try:
            pool = await self._pool(profile, template)
        except (SessionError, SandboxStartError) as exc:
            raise RestoreRefused(
                f"the image is of profile {profile!r} and template {template!r}: {exc}"
            ) from exc
        return pool.limits, pool.profile.runtime_dir, pool.profile.system

    async def _checkpoint(
        self, session: Session, home: Path, *, keeps_running: bool, compressed: bool = True
    ) -> int:
        """Save a running session's image into home (its size). A session with egress has
        its door closed and its connections ended first, and one whose ports were reached
        its ports door shut (gVisor cannot save a socket connected to the host); the doors
        open again if the sandbox runs on. The supervisor lets its spare leader go, and ends
        its own link to the host, last (the ports' shut goes through it)."""
        assert session.kernel is not None
        kernel = session.kernel
        policy = session.egress
        ports = await self.doors.shut_ports(session)
        stopped = False  # saved, and its sandbox stopped
        try:
            await kernel.rest_supervisor()
            if policy is not None:
                await self.doors.shut_for_checkpoint(session)
            try:
                size = await self.checkpoints.save(session.kernel, home, compressed=compressed)
            except BaseException:
                if policy is not None and session.kernel is not None and session.kernel.alive:
                    await self.doors.open(session, policy)
                raise
            if policy is not None and keeps_running:
                await self.doors.open(session, policy)
            stopped = not keeps_running
        finally:
            if stopped:
                await self.doors.close_ports(session.id)
            else:
                kernel.relink_supervisor()
                if ports is not None:
                    ports.reopen()  # reached again by its next request
        return size

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
