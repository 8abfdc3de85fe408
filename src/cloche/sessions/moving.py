"""The verbs a cluster moves sessions between nodes with: export a paused session's record
and image, adopt them on another node, and release the first.

The fourth layer of `LocalSessionManager` (`sessions.local`); the cluster's agent calls
them (`cloche.cluster.agent`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from cloche.errors import (
    CheckpointFailed,
    SessionNotFound,
    SnapshotNotFound,
)
from cloche.sessions.durability import DurableSessions
from cloche.sessions.durable import pack_home, unpack_home
from cloche.sessions.session import SessionState
from cloche.sessions.store import RecordState, SessionRecord, SnapshotRecord

if TYPE_CHECKING:
    pass

log = logging.getLogger("cloche.session")


class MovableSessions(DurableSessions):
    """Saved sessions that can also be handed to another node, and taken in from one."""

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
        self._sessions[record.id] = await asyncio.to_thread(self._paused_session, record)

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
