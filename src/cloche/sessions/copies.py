"""Copies of a session of one machine: snapshots (taken, listed, deleted, restored into a
new session) and forks (copies made at once from one image).

The fifth layer of `LocalSessionManager` (`sessions.local`), over `sessions.durability`,
whose checkpoint and restore they use.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import time

from cloche.errors import ForkRefused, KernelDied, SessionNotFound, SnapshotNotFound
from cloche.sessions.doors import egress_record
from cloche.sessions.durability import DurableSessions
from cloche.sessions.history import History
from cloche.sessions.kernel import KernelClient
from cloche.sessions.manager import new_session_id
from cloche.sessions.session import Session, SessionInfo, owner_key
from cloche.sessions.store import SnapshotRecord
from cloche.volumes.paths import VolumeMount

log = logging.getLogger("cloche.session")
# A fork's image is restored at once into its copies, then deleted: uncompressed, it is
# written and restored faster (benchmarks/bench_durability.py measures both).
FORK_IMAGE_COMPRESSED = False


class CopyableSessions(DurableSessions):
    """Saved sessions that can also be copied: snapshots and forks."""

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
                template=session.template,
                env=dict(session.env),
                volumes=[m.to_json() for m in session.volumes],
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
        mounts = [VolumeMount(**v) for v in record.volumes]
        why = f": snapshot {snapshot_id} mounts it, and it was deleted since"
        with self._claim_volumes(record.owner_key, mounts, why):
            await self._room_for(1)
            started = time.perf_counter()
            home = self.store.snapshot_dir(snapshot_id)
            setup = self._volume_setup(record.owner_key, mounts)
            kernel = await self._restore(
                home, record.origin, record.profile, record.template, setup
            )
            return await self._adopt_snapshot(snapshot_id, record, kernel, started, metadata)

    async def _adopt_snapshot(
        self,
        snapshot_id: str,
        record: SnapshotRecord,
        kernel: KernelClient,
        started: float,
        metadata: dict[str, str] | None,
    ) -> Session:
        home = self.store.snapshot_dir(snapshot_id)
        self.observer.snapshot_restored(time.perf_counter() - started)
        history = await asyncio.to_thread(History.load, home, self.config.history_cells)
        session = self._adopt(
            kernel,
            record.owner_key,
            record.profile,
            record.execution_count,
            metadata=record.metadata if metadata is None else metadata,
            history=history,
            template=record.template,
            env=record.env,
            volumes=[VolumeMount(**v) for v in record.volumes],
        )
        await self._follow_running(session)
        return session

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
                *(
                    self._restore(
                        home,
                        origin,
                        session.profile,
                        session.template,
                        self._volume_setup(session.owner_key, session.volumes),
                    )
                    for _ in range(count)
                ),
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
                            template=session.template,
                            env=session.env,
                            volumes=session.volumes,
                        )
                    )
            failed = [k for k in kernels if isinstance(k, BaseException)]
            if failed:
                raise failed[0]
            if session.egress is not None:  # each copy gets a door of its own
                for copy in made:
                    copy.placeholders = dict(session.placeholders)
                    await self.doors.open(copy, session.egress)
            for copy in made:  # each copy's processes go on, its own
                await self._follow_running(copy)
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
