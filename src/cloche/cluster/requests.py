"""What a node agent answers front ends about its sessions, snapshots and files on the data
path: each request (`_op_<op>`, as `NodeAgent._handle` finds it) done by the node's manager
and its answer encoded for the wire (`codec`). Files go in pieces both ways: streamed in
(`stream_*`) and read out (`read_*`), by handle.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from cloche.cluster import codec
from cloche.errors import PathRefused
from cloche.sessions.kernel import EventCallback
from cloche.sessions.local import LocalSessionManager

MAX_OPEN_READS = 64  # files being read through the data path at once, per node


class SessionRequests:
    """The data path's requests about a node's sessions (a part of `NodeAgent`)."""

    manager: LocalSessionManager
    _streams: dict[int, Any]  # open streamed files, by handle
    _reads: dict[int, AsyncGenerator[bytes, None]]  # files being read, by handle
    _stream_numbers: itertools.count[int]

    def stats(self) -> dict[str, Any]:
        """The node's figures, sent along with what changes them (the agent's)."""
        raise NotImplementedError

    async def _op_create(
        self,
        on_event: EventCallback,
        owner: str | None,
        profile: str,
        snapshot: str | None,
        egress: str | dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
        cell_timeout_s: float | None = None,
        template: str | None = None,
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        info = await self.manager.create(
            owner,
            profile,
            snapshot,
            egress,
            metadata,
            cell_timeout_s=cell_timeout_s,
            template=template,
            env=env,
        )
        return {"info": codec.info_out(info), "stats": self.stats()}

    async def _op_info(self, on_event: EventCallback, session_id: str, owner: str | None) -> Any:
        return codec.info_out(await self.manager.info(session_id, owner))

    async def _op_sessions(
        self,
        on_event: EventCallback,
        owner: str | None,
        every: bool = False,
        state: str | None = None,
        profile: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Any:
        found = await self.manager.sessions(
            owner, every=every, state=state, profile=profile, metadata=metadata
        )
        return [codec.info_out(info) for info in found]

    async def _op_set_metadata(
        self,
        on_event: EventCallback,
        session_id: str,
        changes: dict[str, str | None],
        owner: str | None,
    ) -> Any:
        return codec.info_out(await self.manager.set_metadata(session_id, changes, owner))

    async def _op_history(
        self,
        on_event: EventCallback,
        session_id: str,
        owner: str | None,
        after: int,
        limit: int | None,
    ) -> Any:
        found = await self.manager.history(session_id, owner, after=after, limit=limit)
        return [entry.to_json() for entry in found]

    async def _op_cell(
        self, on_event: EventCallback, session_id: str, number: int, owner: str | None
    ) -> Any:
        return (await self.manager.cell(session_id, number, owner)).to_json()

    async def _op_execute(
        self,
        on_event: EventCallback,
        session_id: str,
        code: str,
        owner: str | None,
        timeout_s: float | None,
        track_files: bool,
        silent: bool,
        stream: bool,
        stdin: bool = False,
        pager: bool = False,
        front_end: str = "",
        accepted: bool = False,
    ) -> Any:
        # With accepted, the front end waits for the cell to be queued (or refused as busy)
        # before it answers: told as an event of its own as soon as the session queues it.
        queued = _TellsWhenSet(on_event) if accepted else None
        result = await self.manager.execute(
            session_id,
            code,
            owner=owner,
            timeout_s=timeout_s,
            on_event=on_event if stream else None,
            track_files=track_files,
            silent=silent,
            stdin=stdin,
            pager=pager,
            front_end=front_end,
            accepted=queued,
        )
        return codec.result_out(result)

    async def _op_interrupt(
        self, on_event: EventCallback, session_id: str, owner: str | None
    ) -> Any:
        return await self.manager.interrupt(session_id, owner)

    async def _op_restart(self, on_event: EventCallback, session_id: str, owner: str | None) -> Any:
        return codec.info_out(await self.manager.restart(session_id, owner))

    async def _op_answer_input(
        self, on_event: EventCallback, session_id: str, owner: str | None, value: str
    ) -> Any:
        return await self.manager.answer_input(session_id, value, owner)

    async def _op_close(
        self, on_event: EventCallback, session_id: str, owner: str | None, reason: str
    ) -> None:
        await self.manager.close(session_id, owner, reason)

    async def _op_snapshot(
        self, on_event: EventCallback, session_id: str, owner: str | None, name: str
    ) -> Any:
        return codec.snapshot_out(await self.manager.snapshot(session_id, owner, name))

    async def _op_snapshots(self, on_event: EventCallback, owner: str | None) -> Any:
        return [codec.snapshot_out(r) for r in await self.manager.snapshots(owner)]

    async def _op_get_snapshot(
        self, on_event: EventCallback, snapshot_id: str, owner: str | None
    ) -> Any:
        return codec.snapshot_out(await self.manager.get_snapshot(snapshot_id, owner))

    async def _op_delete_snapshot(
        self, on_event: EventCallback, snapshot_id: str, owner: str | None
    ) -> None:
        await self.manager.delete_snapshot(snapshot_id, owner)

    async def _op_fork(
        self, on_event: EventCallback, session_id: str, count: int, owner: str | None
    ) -> Any:
        copies = await self.manager.fork(session_id, count, owner)
        return {"copies": [codec.info_out(i) for i in copies], "stats": self.stats()}

    async def _op_pause(self, on_event: EventCallback, session_id: str, owner: str | None) -> Any:
        return codec.info_out(await self.manager.pause(session_id, owner))

    async def _op_resume(self, on_event: EventCallback, session_id: str, owner: str | None) -> Any:
        return codec.info_out(await self.manager.resume(session_id, owner))

    async def _op_list_files(
        self, on_event: EventCallback, session_id: str, owner: str | None
    ) -> Any:
        return codec.listing_out(await self.manager.list_files(session_id, owner))

    async def _op_read_file(
        self, on_event: EventCallback, session_id: str, path: str, owner: str | None
    ) -> Any:
        return codec.bytes_out(await self.manager.read_file(session_id, path, owner))

    async def _op_write_files(
        self, on_event: EventCallback, session_id: str, files: list[list[str]], owner: str | None
    ) -> None:
        decoded = [(path, codec.bytes_in(data)) for path, data in files]
        await self.manager.write_files(session_id, decoded, owner)

    async def _op_stream_open(
        self, on_event: EventCallback, session_id: str, path: str, owner: str | None
    ) -> int:
        """A streamed file, written from the chunks that `stream_chunk` brings."""
        await self.manager.info(session_id, owner)
        handle = next(self._stream_numbers)
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)

        async def pieces() -> AsyncIterator[bytes]:
            while (chunk := await chunks.get()) is not None:
                yield chunk

        writing = asyncio.create_task(self.manager.write_stream(session_id, path, pieces(), owner))
        self._streams[handle] = (chunks, writing)
        return handle

    async def _op_stream_chunk(self, on_event: EventCallback, handle: int, data: str) -> None:
        chunks, writing = self._stream(handle)
        put = asyncio.ensure_future(chunks.put(codec.bytes_in(data)))
        await asyncio.wait([put, writing], return_when=asyncio.FIRST_COMPLETED)
        if not put.done():  # the writer stopped (refused): say why, and forget it
            put.cancel()
            self._streams.pop(handle, None)
            await writing

    async def _op_stream_end(self, on_event: EventCallback, handle: int, commit: bool) -> int:
        chunks, writing = self._stream(handle)
        del self._streams[handle]
        if commit:
            await chunks.put(None)
            size: int = await writing
            return size
        writing.cancel()
        await asyncio.gather(writing, return_exceptions=True)
        return 0

    def _stream(self, handle: int) -> tuple[asyncio.Queue[bytes | None], asyncio.Task[int]]:
        if handle not in self._streams:
            raise PathRefused("", f"no streamed file {handle}")
        found: tuple[asyncio.Queue[bytes | None], asyncio.Task[int]] = self._streams[handle]
        return found

    async def _op_read_open(
        self, on_event: EventCallback, session_id: str, path: str, owner: str | None
    ) -> dict[str, int]:
        """A file to be read in pieces (`read_piece`, until one is empty); its size."""
        if len(self._reads) >= MAX_OPEN_READS:  # forgotten by front ends that went away
            oldest = next(iter(self._reads))
            await self._reads.pop(oldest).aclose()
        size, pieces = await self.manager.read_stream(session_id, path, owner)
        handle = next(self._stream_numbers)
        self._reads[handle] = pieces
        return {"handle": handle, "size": size}

    async def _op_read_piece(self, on_event: EventCallback, handle: int) -> str:
        """The next piece of an opened file, base64; "" at its end (then it is closed)."""
        pieces = self._reads.get(handle)
        if pieces is None:
            raise PathRefused("", f"no file opened for reading as {handle}")
        try:
            return codec.bytes_out(await anext(pieces))
        except StopAsyncIteration:
            del self._reads[handle]
            return ""

    async def _op_read_close(self, on_event: EventCallback, handle: int) -> None:
        pieces = self._reads.pop(handle, None)
        if pieces is not None:
            await pieces.aclose()

    async def _op_install_packages(
        self, on_event: EventCallback, session_id: str, specs: list[str], owner: str | None
    ) -> Any:
        return await self.manager.install_packages(session_id, specs, owner)


class _TellsWhenSet(asyncio.Event):
    """An event that, once set, sends the front end a `codec.ACCEPTED` event."""

    def __init__(self, on_event: EventCallback) -> None:
        super().__init__()
        self._on_event = on_event

    def set(self) -> None:
        if not self.is_set():
            self._on_event({"type": codec.ACCEPTED})
        super().set()
