"""`LocalSessionManager`: the sessions of one machine, from taking over what a previous
server left in the data directory to pausing every live session at shutdown (or, on a
cluster node declared dead, abandoning them all).

Its verbs come in layers, one module each: live sessions (`sessions.core`), the volumes
they mount (`sessions.mounts`), making them (`sessions.creation`), what they do
(`sessions.running`), saving them (`sessions.durability`), copying them
(`sessions.copies`), moving them to other nodes (`sessions.moving`).
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import logging
import os
import time
from collections.abc import AsyncIterable
from dataclasses import replace

from cloche.config import MIB
from cloche.errors import (
    ClocheError,
)
from cloche.sandbox.images import TemplateInfo, TemplateSource
from cloche.sandbox.layers import System
from cloche.sessions.moving import MovableSessions
from cloche.sessions.session import Session
from cloche.sessions.store import RecordState, SessionRecord
from cloche.sessions.templates import Templates

log = logging.getLogger("cloche.session")


class LocalSessionManager(MovableSessions):
    """Sessions held in this process, each in its own sandbox from `backend`; paused ones
    and snapshots on disk under --data-dir (see `LiveSessions`)."""

    @functools.cached_property
    def template_catalog(self) -> Templates:
        """The templates of this machine (--templates-dir)."""
        return Templates(
            self.config.templates_root, self.uses_template, self.config.template_max_mib * MIB
        )

    def uses_template(self, name: str) -> bool:
        """Whether a live or paused session was made from the template."""
        return any(s.template == name for s in self._sessions.values())

    async def templates(self) -> builtins.list[TemplateInfo]:
        return self.template_catalog.list()

    async def template(self, name: str) -> TemplateInfo:
        return self.template_catalog.get(name)

    async def build_template(
        self,
        name: str,
        source: TemplateSource,
        upload: AsyncIterable[bytes] | None = None,
    ) -> TemplateInfo:
        return await self.template_catalog.build(name, source, upload)

    async def delete_template(self, name: str) -> None:
        self.template_catalog.check_deletable(name)
        await self.profile_pools.drop_template(name)  # its warm sandboxes sit on its rootfs
        await self.template_catalog.delete(name)

    def _system_of(self, template: str) -> System:
        """A template of this machine's catalogue (unless the manager was given others)."""
        if self.template_systems is not None:
            return super()._system_of(template)
        return self.template_catalog.system(template)

    async def start(self, forget: bool = False) -> None:
        """forget: delete the sessions and snapshots the data directory holds first, unread
        (a cluster node's successor on its machine: they were told lost with it)."""
        await asyncio.to_thread(self.backend.prepare)
        try:
            await asyncio.to_thread(self.store.open)
            if forget:
                await asyncio.to_thread(self.store.forget_all)
            crashed, resumable = await asyncio.to_thread(self._load)
            await self.template_catalog.open()  # once the data dir is ours (its lock)
            # After the backend's start: the sandboxes a crashed server left are gone, so
            # its volumes' mounts can go too.
            await asyncio.to_thread(self.volume_store.open)
        except BaseException:
            await asyncio.to_thread(self.volume_store.close)
            await asyncio.to_thread(self.backend.shutdown)
            raise
        for record in crashed:  # told now, on the loop: they ended with the last server
            self.observer.session_closed("lost", "server_crashed")
            data = {"end_reason": "server_crashed", "reason": "lost"}
            self.observer.event("session.closed", record.id, record.owner_key, data)
        await asyncio.to_thread(self.installer.prepare)
        self.profile_pools.start()
        self._reaper = asyncio.create_task(self._reap(), name="cloche-reaper")
        if self.config.resume_at_start and self.backend.can_checkpoint:
            self._in_background(self._resume_eagerly(resumable))

    def _load(self) -> tuple[builtins.list[SessionRecord], builtins.list[Session]]:
        """Take over what a previous server left in the data directory (blocking): the
        sessions that were live when it died, and those it paused as it stopped."""
        crashed = []
        resumable = []
        for snapshot in self.store.snapshot_records():
            self._snapshots[snapshot.id] = snapshot
        for record in self.store.session_records():
            if record.state is RecordState.PAUSED:
                session = self._paused_session(record)
                self._sessions[record.id] = session
                if record.paused_for == "shutdown":
                    resumable.append(session)
                continue
            if record.state is RecordState.LIVE:  # its server died with it
                record = replace(record, state=RecordState.LOST)
                self.store.save(record)
                self.checkpoints.discard(self.store.session_dir(record.id))
                crashed.append(record)
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
        return crashed, resumable

    async def _resume_eagerly(self, sessions: builtins.list[Session]) -> None:
        """Bring back the sessions the last server paused as it stopped, most recently used
        first, a few at a time (one per core), while there is room: their next cell finds
        them running instead of waiting for a restore."""
        sessions = sorted(sessions, key=lambda s: s.last_active, reverse=True)
        limit = asyncio.Semaphore(os.cpu_count() or 1)
        started = time.perf_counter()

        async def resume(session: Session) -> None:
            async with limit:
                if self._stopped or self.live_count >= self.config.max_sessions:
                    return  # no room: it stays paused, and comes back on its next request
                if self._sessions.get(session.id) is not session or not session.paused:
                    return  # closed, moved or woken meanwhile
                try:
                    await session.wake()
                except ClocheError as exc:
                    log.warning("session %s not resumed at start: %s", session.id, exc)

        await asyncio.gather(*(resume(s) for s in sessions))
        if sessions:
            log.info(
                "resumed at start: %d of %d sessions paused at shutdown in %.1f s",
                sum(1 for s in sessions if not s.paused),
                len(sessions),
                time.perf_counter() - started,
            )

    async def stop(self) -> None:
        """Pause every live session to disk (a few at a time; running cells interrupted
        first), then free every sandbox. A session that can't be saved is closed."""
        await self._quiesce()
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
            self.profile_pools.close(),
            self.template_catalog.close(),
            *(keep(s) for s in live),
            return_exceptions=True,
        )
        await self._free()

    async def abandon(self, reason: str) -> int:
        """Close every session held here, live or paused, and delete every snapshot, saving
        nothing; then free every sandbox, as `stop` does. For a cluster node declared dead:
        its sessions were told lost, and an image kept would bring one back. How many
        sessions went."""
        await self._quiesce()
        sessions = builtins.list(self._sessions.values())
        for session in sessions:
            self._remove(session, reason)
        snapshots = [self.store.snapshot_dir(i) for i in self._snapshots]
        self._snapshots.clear()
        await asyncio.gather(
            self.profile_pools.close(),
            *(self._close(s, reason) for s in sessions),
            *(asyncio.to_thread(self.store.remove, home) for home in snapshots),
            return_exceptions=True,
        )
        await self._free()
        return len(sessions)

    async def _quiesce(self) -> None:
        """Take nothing new on: no pool refills, no reaping, page-outs under way finished."""
        self._stopped = True
        await self.profile_pools.stop_building()
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        await asyncio.gather(*self._pausing.values(), return_exceptions=True)

    async def _free(self) -> None:
        """Once every session is paused or closed: their doors, the sandboxes' state."""
        await asyncio.gather(*self._closing, return_exceptions=True)
        await self.command_runs.stop()
        await self.doors.close_all()
        await asyncio.to_thread(self.backend.shutdown)
        await asyncio.to_thread(self.volume_store.close)  # their sandboxes are gone
        self.store.close()
