"""Websockets with fewer system calls: a turn's frames in one write, reading paused late.

A Jupyter cell is four messages to its client (`status busy`, `execute_input`,
`execute_reply`, `status idle`), and uvicorn writes each frame to the socket as it is sent:
a system call per message. With 100 busy kernels those writes were 23% of the server's CPU
(py-spy, BENCHMARKS.md). Here a connection's frames are held until the loop's next turn and
go out in one write, in the order sent; nothing waits longer than that turn, and a close
writes what is held first.

uvicorn also stops reading a websocket after each message it receives until the app has
taken it (two epoll_ctl calls per request, 6% of the server's CPU there). Here reading stops
only once MAX_UNREAD messages wait for the app: the same bound on memory, taken later.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

MAX_UNREAD = 16  # messages received and not yet taken by the app before reading stops


class BatchedTransport:
    """A transport whose writes in one turn of the loop reach the socket as one write."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self.reading_paused = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(bytes(data))

    def flush(self) -> None:
        """Write what is held (nothing, if the socket is closing: it could not be sent)."""
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(b"".join(held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def pause_reading(self) -> None:
        """Asked after every message received: see pause_reading_at."""

    def pause_reading_at(self, unread: int) -> None:
        """Stop reading once `unread` messages wait for the app."""
        if unread >= MAX_UNREAD and not self.reading_paused and not self.is_closing():
            self.reading_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        """Asked once the app took every message received."""
        if self.reading_paused:
            self.reading_paused = False
            self._transport.resume_reading()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading...
        return getattr(self._transport, name)


class BatchedWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's websocket protocol (the `websockets` library's sans-I/O core) writing
    and pausing through a BatchedTransport."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert isinstance(transport, asyncio.Transport)
        self.batched = BatchedTransport(transport, self.loop)
        self.transport = self.batched  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.batched.pause_reading_at(self.queue.qsize())
