"""The verbs that save a session of one machine: pause, resume, snapshots, forks, restart,
and paging idle sessions out to make room.

The second layer of `LocalSessionManager` (`sessions.local`), over `sessions.core`'s live
sessions; the durable form itself (runsc checkpoint and restore of one kernel, the images
on disk) is `sessions.durable`'s.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cloche.config import Limits
from cloche.errors import (
    CheckpointFailed,
    ClocheError,
    ForkRefused,
    KernelDied,
    RestoreRefused,
    SandboxStartError,
    SessionLost,
    SessionMoved,
    SessionNotFound,
    SnapshotNotFound,
    TooManyPausedSessions,
    TooManySessions,
    UnknownProfile,
)
from cloche.sessions.core import LiveSessions
from cloche.sessions.doors import egress_record, placeholders_of
from cloche.sessions.durable import carry_disk
from cloche.sessions.history import History
from cloche.sessions.kernel import KernelClient
from cloche.sessions.manager import new_session_id
from cloche.sessions.session import Session, SessionInfo, SessionState, owner_key
from cloche.sessions.store import RecordState, SessionRecord, SnapshotRecord

if TYPE_CHECKING:
    pass

log = logging.getLogger("cloche.session")
# A fork's image is restored at once into its copies, then deleted: uncompressed, it is
# written and restored faster (benchmarks/bench_durability.py measures both).
FORK_IMAGE_COMPRESSED = False


class DurableSessions(LiveSessions):
    """Live sessions that can also be saved to disk and brought back, copied and forked."""

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
            await self.doors.open(session, session.egress)
        self.store.save(self._record(session, RecordState.LIVE))
        log.info("session restart id=%s sandbox=%s", session.id, fresh.id)
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
            await self.doors.open(session, session.egress)
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
            await asyncio.to_thread(session.history.save, home)
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
                egress=egress_record(session),
                metadata=dict(session.metadata),
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
        self._tell("session.snapshotted", session, {"snapshot": snapshot_id, "name": name})
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

    async def _from_snapshot(
        self, snapshot_id: str, owner: str | None, metadata: dict[str, str] | None = None
    ) -> Session:
        record = self._snapshot(snapshot_id, owner)
        await self._room_for(1)
        started = time.perf_counter()
        home = self.store.snapshot_dir(snapshot_id)
        kernel = await self._restore(home, record.origin, record.profile)
        self.observer.snapshot_restored(time.perf_counter() - started)
        history = await asyncio.to_thread(History.load, home, self.config.history_cells)
        return self._adopt(
            kernel,
            record.owner_key,
            record.profile,
            record.execution_count,
            metadata=record.metadata if metadata is None else metadata,
            history=history,
        )

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
                size = await self._checkpoint(
                    session, home, keeps_running=True, compressed=FORK_IMAGE_COMPRESSED
                )
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
                            kernel,
                            session.owner_key,
                            session.profile,
                            session.execution_count,
                            metadata=session.metadata,
                            history=session.history,
                            cell_timeout_s=session.cell_timeout_s,
                        )
                    )
            failed = [k for k in kernels if isinstance(k, BaseException)]
            if failed:
                raise failed[0]
            if session.egress is not None:  # each copy gets a door of its own
                for copy in made:
                    copy.placeholders = dict(session.placeholders)
                    await self.doors.open(copy, session.egress)
            seconds = time.perf_counter() - started
            self.observer.forked(count, seconds)
            for copy in made:  # a copy is a new session: its life starts as every other's
                data = {"profile": copy.profile, "metadata": copy.metadata}
                self._tell("session.created", copy, {**data, "forked_from": session.id})
            copies = [copy.id for copy in made]
            told = {"copies": copies, "profile": session.profile, "seconds": round(seconds, 3)}
            self._tell("session.forked", session, told)
            log.info("fork session=%s copies=%s", session_id, ",".join(s.id for s in made))
            return [s.info() for s in made]
        except BaseException:
            for copy in made:
                self._forget(copy, "failed-fork")
            raise
        finally:
            await asyncio.to_thread(self.store.remove, home)

    async def _checkpoint(
        self, session: Session, home: Path, *, keeps_running: bool, compressed: bool = True
    ) -> int:
        """Save a running session's image into home (its size). A session with egress has
        its door closed and its connections ended first (gVisor cannot save a socket
        connected to the host); the door opens again if the sandbox runs on."""
        assert session.kernel is not None
        policy = session.egress
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
