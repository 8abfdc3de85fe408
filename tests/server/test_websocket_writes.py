"""Websocket frames of one turn of the event loop go out in one write."""

from __future__ import annotations

import asyncio

from cloche.server.http.websocket_writes import (
    MAX_UNREAD,
    BatchedTransport,
    BatchedWebSocketProtocol,
)
from support import ServerThread


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.calls.append(("write", bytes(data)))

    def close(self) -> None:
        self.closing = True
        self.calls.append(("close", b""))

    def abort(self) -> None:
        self.closing = True
        self.calls.append(("abort", b""))

    def pause_reading(self) -> None:
        self.calls.append(("pause", b""))

    def resume_reading(self) -> None:
        self.calls.append(("resume", b""))

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default


async def _turn() -> None:
    """Let the loop run what was scheduled with call_soon before this."""
    await asyncio.sleep(0)


async def test_frames_of_one_turn_are_one_write_in_order() -> None:
    real = RecordingTransport()
    batched = BatchedTransport(real, asyncio.get_running_loop())
    batched.write(b"busy|")
    batched.write(b"")
    batched.write(bytearray(b"input|"))
    assert real.calls == []  # held until the turn ends
    await _turn()
    assert real.calls == [("write", b"busy|input|")]
    batched.write(b"reply|")
    await _turn()
    batched.write(b"idle|")
    await _turn()
    assert real.calls[1:] == [("write", b"reply|"), ("write", b"idle|")]


async def test_close_writes_what_is_held_first_and_abort_drops_it() -> None:
    loop = asyncio.get_running_loop()
    real = RecordingTransport()
    batched = BatchedTransport(real, loop)
    batched.write(b"last words")
    batched.close()
    await _turn()  # the flush scheduled by the write finds nothing more
    assert real.calls == [("write", b"last words"), ("close", b"")]

    real = RecordingTransport()
    batched = BatchedTransport(real, loop)
    batched.write(b"never sent")
    batched.abort()
    await _turn()
    assert real.calls == [("abort", b"")]


async def test_nothing_is_written_to_a_closing_socket() -> None:
    real = RecordingTransport()
    batched = BatchedTransport(real, asyncio.get_running_loop())
    batched.write(b"too late")
    real.closing = True  # the connection was lost meanwhile
    await _turn()
    assert real.calls == []
    assert batched.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the socket's


async def test_reading_stops_only_when_many_messages_wait_for_the_app() -> None:
    real = RecordingTransport()
    batched = BatchedTransport(real, asyncio.get_running_loop())
    batched.pause_reading()  # what uvicorn asks after each message received
    batched.pause_reading_at(MAX_UNREAD - 1)
    batched.resume_reading()  # the app took them: nothing was paused, nothing to undo
    assert real.calls == []
    batched.pause_reading_at(MAX_UNREAD)
    batched.pause_reading_at(MAX_UNREAD + 1)
    assert real.calls == [("pause", b"")]
    batched.resume_reading()
    batched.resume_reading()
    assert real.calls == [("pause", b""), ("resume", b"")]


def test_the_servers_websockets_use_the_batched_protocol(server: ServerThread) -> None:
    assert server.server.http is not None
    assert server.server.http.server.config.ws_protocol_class is BatchedWebSocketProtocol
