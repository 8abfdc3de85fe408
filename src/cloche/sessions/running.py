"""What live sessions do: run cells (interrupted, answering input()), keep their history
and labels, install packages, and hold files.

The second layer of `LocalSessionManager` (`sessions.local`), over `sessions.core`'s live
sessions: the verbs a front end uses on one session while it lives.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import time
from collections.abc import AsyncGenerator, AsyncIterable, Mapping, Sequence
from dataclasses import replace

from cloche.errors import CellNotFound, KernelDied, SessionNotFound
from cloche.packages.bridge import SilentRun
from cloche.protocol.paths import normalise
from cloche.sandbox.files import FileListing, StreamedFile, WorkdirFiles
from cloche.sessions.core import LiveSessions
from cloche.sessions.history import CellEntry, entry_of
from cloche.sessions.kernel import EventCallback
from cloche.sessions.manager import READ_PIECE_BYTES, InstalledPackages, check_metadata
from cloche.sessions.result import CellResult, CellStatus
from cloche.sessions.session import Session, SessionInfo
from cloche.sessions.store import RecordState

STREAM_FLUSH_BYTES = 1 << 20  # a streamed file is written in pieces of about this size


class RunningSessions(LiveSessions):
    """Live sessions that run cells, keep their history, install packages and hold files."""

    async def set_metadata(
        self, session_id: str, changes: Mapping[str, str | None], owner: str | None = None
    ) -> SessionInfo:
        session = self._find(session_id, owner)
        session.metadata = check_metadata(session.metadata, changes)
        if session.paused:  # its record on disk is what a restart reads
            record = await asyncio.to_thread(self.store.session_record, session_id)
            await asyncio.to_thread(self.store.save, replace(record, metadata=session.metadata))
        else:
            state = RecordState.LIVE
            await asyncio.to_thread(self.store.save, self._record(session, state))
        return session.info()

    async def history(
        self,
        session_id: str,
        owner: str | None = None,
        *,
        after: int = 0,
        limit: int | None = None,
    ) -> builtins.list[CellEntry]:
        return self._find(session_id, owner).history.after(after, limit)

    async def cell(self, session_id: str, number: int, owner: str | None = None) -> CellEntry:
        entry = self._find(session_id, owner).history.get(number)
        if entry is None:
            raise CellNotFound(session_id, number)
        return entry

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
        front_end: str = "",
        accepted: asyncio.Event | None = None,
    ) -> CellResult:
        session = self._find(session_id, owner)
        limit = self.limits.cell_timeout_s
        timeout_s = timeout_s if timeout_s and timeout_s > 0 else session.cell_timeout_s
        timeout = min(timeout_s, limit) if timeout_s and timeout_s > 0 else limit
        started = time.perf_counter()
        if not silent:
            self._tell("cell.started", session, {"front_end": front_end})
        try:
            result = await session.execute(
                code,
                timeout_s=timeout,
                on_event=on_event,
                track_files=track_files,
                silent=silent,
                stdin=stdin,
                pager=pager,
                accepted=accepted,
            )
        except KernelDied as exc:
            self._forget(session, "lost")
            raise SessionNotFound(session_id) from exc
        self.observer.cell_finished(result, time.perf_counter() - started)
        if not silent:
            self._keep(session, result, code, front_end)
        if result.status is CellStatus.KILLED:
            self._forget(session, "killed")
        return result

    def _keep(self, session: Session, result: CellResult, code: str, front_end: str) -> None:
        """Put a finished cell into its session's history, and tell of it."""
        ended = time.time()
        entry = entry_of(
            result,
            code,
            session.history.next_number(),
            started_at=ended - result.duration_ms / 1000,
            ended_at=ended,
            front_end=front_end,
            output_bytes=self.config.history_output_bytes,
        )
        session.history.add(entry)
        data = {
            "number": entry.number,
            "execution_count": entry.execution_count,
            "status": entry.status,
            "end_reason": entry.end_reason,
            "duration_s": entry.duration_s,
            "front_end": front_end,
        }
        self._tell("cell.finished", session, data)

    async def install_packages(
        self, session_id: str, specs: Sequence[str], owner: str | None = None
    ) -> InstalledPackages:
        session = self._find(session_id, owner)
        await session.wake()
        pip = session.kernel.pip if session.kernel is not None else None
        if pip is None:  # closed while it was being woken
            raise SessionNotFound(session_id)

        async def run_silent(code: str) -> SilentRun:
            result = await self.execute(session_id, code, owner=owner, silent=True)
            ok = result.status is CellStatus.OK
            return SilentRun(ok, result.status.value, result.message or "", result.error)

        return await pip.install_through_cell(list(specs), run_silent)

    async def interrupt(self, session_id: str, owner: str | None = None) -> bool:
        session = self._find(session_id, owner)
        await session.wake()
        return session.interrupt()

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

    async def read_stream(
        self, session_id: str, path: str, owner: str | None = None
    ) -> tuple[int, AsyncGenerator[bytes, None]]:
        files = await self.files(session_id, owner)
        fd, size = await asyncio.to_thread(files.open_for_reading, path)
        return size, _pieces(fd, size)

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


async def _pieces(fd: int, size: int) -> AsyncGenerator[bytes, None]:
    """An open file's first size bytes in pieces (a file still growing is cut at the size
    it had when opened, as its Content-Length said); the descriptor is closed at the end."""
    try:
        left = size
        while left > 0:
            piece = await asyncio.to_thread(os.read, fd, min(READ_PIECE_BYTES, left))
            if not piece:
                break  # cut short meanwhile: the reader sees fewer bytes than announced
            left -= len(piece)
            yield piece
    finally:
        os.close(fd)
