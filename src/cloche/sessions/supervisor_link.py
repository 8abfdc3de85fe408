"""The host's end of a sandbox's process supervisor (`cloche.kernel.procd`): a connection
the supervisor makes to the sandbox's door (`procd.sock`), apart from the kernel's channel.

The host asks for it through the kernel (`proc.link`, with a token of this link's own) when
the sandbox has started or been restored, between cells; the supervisor connects and
says hello with the token. It ends after the supervisor's `proc.rest`, before each
checkpoint (gVisor cannot save a socket connected to the host), and is asked for again if
the sandbox runs on. Frames to the supervisor wait here while there is none. A link that
ends unasked is asked for again (a few times): the kernel then either passes the request on
to a supervisor that is there, or says it has gone (`proc.gone`, from `KernelClient`).

Whatever comes through the door is untrusted: anything in the sandbox may connect, so a
connection counts only once its first frame carries the token, one at a time, and its
frames are bounded and checked as the kernel's are (`ProcessTable.on_message`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cloche.errors import InvalidMessage, ProtocolError
from cloche.network.door_socket import listen_at
from cloche.protocol.framing import FrameDecoder, decode_body, encode_frame

log = logging.getLogger("cloche.kernel")

SOCKET = "procd.sock"  # in a sandbox's door directory (its path inside goes in `proc.link`)
GONE = "the sandbox's process supervisor has ended (killed from inside?)"
LINK_WITHIN_S = 10.0  # a checkpoint waits this long for a link asked for to be made
END_WITHIN_S = 5.0  # ... and for the supervisor to end it after its `proc.rest`
_MAX_KEPT = 4096  # frames kept for a link that has not come; past this it never will
MAX_RELINKS = 5  # links that ended unasked, asked for again; past this the supervisor is gone
_BACKLOG = 4


class SupervisorLink:
    """One sandbox's link to its supervisor.

    Args:
        sandbox_id: whose (in logs).
        max_frame_bytes: the largest frame believed.
        on_message: each frame from the supervisor (raises InvalidMessage for a bad one).
        on_gone: the supervisor is gone (its reason): every request fails with it.
    """

    def __init__(
        self,
        sandbox_id: str,
        max_frame_bytes: int,
        on_message: Callable[[dict[str, Any]], None],
        on_gone: Callable[[str], None],
    ) -> None:
        self.sandbox_id = sandbox_id
        self._max_frame_bytes = max_frame_bytes
        self._on_message = on_message
        self._on_gone = on_gone
        self._ask: Callable[[dict[str, Any]], None] | None = None  # to the kernel
        self._path: Path | None = None
        self._inside = ""
        self._listener: socket.socket | None = None
        self._token = ""
        self._transport: asyncio.Transport | None = None
        self._kept: list[bytes] = []
        self._made: asyncio.Future[None] | None = None  # asked for, not yet made
        self._ended: asyncio.Future[None] | None = None  # made, not yet ended
        self._resting = False  # a `proc.rest` is under way: the end that follows is expected
        self._relinks = 0  # links asked for again after an end nobody asked for
        self.closed = False
        self.lost_why: str | None = None

    @property
    def linked(self) -> bool:
        return self._transport is not None

    def open(self, door_dir: Path, inside: str, ask: Callable[[dict[str, Any]], None]) -> None:
        """Listen in the sandbox's door directory and ask for the link (through ask, to
        the kernel)."""
        self._path = door_dir / SOCKET
        self._inside = f"{inside}/{SOCKET}"
        self._ask = ask
        self._listener = listen_at(self._path, _BACKLOG)  # a supervisor without root connects
        asyncio.get_running_loop().add_reader(self._listener, self._accept)
        self.relink()

    def relink(self) -> None:
        """Ask the supervisor to connect (again), with a new token."""
        if self.closed or self.lost_why is not None or self._ask is None or self._transport:
            return
        self._token = secrets.token_urlsafe(24)
        if self._made is None or self._made.done():
            self._made = asyncio.get_running_loop().create_future()
        self._ask({"op": "proc.link", "path": self._inside, "token": self._token})

    def send(self, message: dict[str, Any]) -> None:
        """A frame to the supervisor, now or once it has connected."""
        frame = encode_frame(message)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame)
            return
        self._kept.append(frame)
        if len(self._kept) > _MAX_KEPT:
            self.gone("the sandbox's process supervisor never connected to the host")

    async def rest(self, ask_rest: Callable[[], Any]) -> None:
        """Before a checkpoint: wait for a link asked for, then have the supervisor end it
        after its `proc.rest` (ask_rest); ended from here if it does not."""
        if self._made is not None and not self._made.done():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LINK_WITHIN_S):
                    await asyncio.shield(self._made)
        if self._transport is None:
            return
        self._resting = True
        ended = self._ended
        try:
            await ask_rest()
            if ended is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(END_WITHIN_S):
                        await asyncio.shield(ended)
        finally:
            transport, self._transport = self._transport, None
            if transport is not None:  # it did not end it: the host does
                transport.close()
            self._resting = False

    def gone(self, why: str) -> None:
        """The supervisor can't be reached any more (told once)."""
        if self.lost_why is not None:
            return
        self.lost_why = why
        self._kept.clear()
        if self._made is not None and not self._made.done():
            self._made.set_result(None)
        self._on_gone(why)

    def close(self) -> None:
        """Stop listening and end the link (the sandbox is going). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._kept.clear()
        if self._made is not None and not self._made.done():
            self._made.set_result(None)
        if self._transport is not None:
            self._transport.close()
        if self._listener is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed
                asyncio.get_running_loop().remove_reader(self._listener)
            self._listener.close()
            self._listener = None
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)

    # -- the connections ---------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:
            log.warning("sandbox %s: its supervisor's door failed: %s", self.sandbox_id, exc)
            return
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.connect_accepted_socket(lambda: _Connection(self), sock))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # closed meanwhile

    def _hello(self, connection: _Connection, message: dict[str, Any]) -> bool:
        """A connection's first frame: is it the supervisor asked for?"""
        token = message.get("token")
        if (
            self.closed
            or self._transport is not None
            or message.get("op") != "proc.hello"
            or not isinstance(token, str)
            or not self._token
            or not hmac.compare_digest(token.encode(), self._token.encode())
        ):
            return False
        self._token = ""  # used once
        assert connection.transport is not None
        self._transport = connection.transport
        self._ended = asyncio.get_running_loop().create_future()
        kept, self._kept = self._kept, []
        for frame in kept:
            self._transport.write(frame)
        if self._made is not None and not self._made.done():
            self._made.set_result(None)
        return True

    def _lost(self, connection: _Connection) -> None:
        if connection.transport is not self._transport or self._transport is None:
            return  # one that never counted
        self._transport = None
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)
        if self._resting or self.closed:
            return
        if self._relinks >= MAX_RELINKS:
            self.gone(GONE)
            return
        self._relinks += 1
        log.warning(
            "sandbox %s: its supervisor's link ended unasked; asking again", self.sandbox_id
        )
        self.relink()


class _Connection(asyncio.Protocol):
    """One connection at the supervisor's door: the supervisor once it has said hello."""

    def __init__(self, link: SupervisorLink) -> None:
        self.link = link
        self.decoder = FrameDecoder(link._max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self.counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        try:
            for body in self.decoder.feed(data):
                message = decode_body(body)
                if not self.counted:
                    self.counted = self.link._hello(self, message)
                    if not self.counted:
                        self.transport.close()
                        return
                else:
                    self.link._on_message(message)
        except (ProtocolError, InvalidMessage) as exc:
            if self.counted:
                why = f"the sandbox's process supervisor broke the protocol ({exc})"
                log.warning("sandbox %s: %s", self.link.sandbox_id, why)
                self.link.gone(why)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.counted:
            self.link._lost(self)
