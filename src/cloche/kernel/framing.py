"""Frames over a non-blocking socket, for a select loop: a 4-byte big-endian length, then
that many bytes of JSON. What comes in is parsed once whole; what goes out waits in a
buffer for as long as the socket does not take it.

The process supervisor (`procd`) speaks this to the kernel (its hello, and the kernel's
`proc.link`), and to the host through the sandbox's door (`HostLink`).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct

TYPE_CHECKING = False  # typing is not imported: the supervisor stays small
if TYPE_CHECKING:
    from typing import Any

HEADER = struct.Struct(">I")
HELLO = {"op": "proc.hello"}  # the supervisor's first frame, which the kernel keeps to itself
_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
# Errors of a send or receive that pass: the sentry short of memory for a moment (a fork bomb
# in the sandbox), as a full buffer does; what waits goes at the socket's next turn.
_PASSING = (errno.ENOMEM, errno.ENOBUFS)


class FramedLink:
    """One socket's frames both ways."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.inbox = b""
        self.outbox = bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def waiting(self) -> bool:
        """Frames wait to be sent: the loop should watch for the socket to take more."""
        return bool(self.outbox)

    def send(self, message: dict[str, Any]) -> None:
        """Send a frame, or keep it for `flush` (OSError: the peer has gone)."""
        body = _encoder.encode(message).encode("utf-8", "backslashreplace")
        was_empty = not self.outbox
        self.outbox += HEADER.pack(len(body)) + body
        if was_empty:
            self.flush()

    def flush(self) -> None:
        """Send what waits, as far as the socket takes it (OSError: the peer has gone)."""
        try:
            while self.outbox:
                sent = self.sock.send(self.outbox)
                del self.outbox[:sent]
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno not in _PASSING:
                raise

    def receive(self) -> list[dict[str, Any]] | None:
        """The frames completed by what the socket has now; None once the peer has gone."""
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            return []
        except OSError as exc:
            if exc.errno in _PASSING:
                return []
            raise
        if not data:
            return None
        self.inbox += data
        frames = []
        while len(self.inbox) >= HEADER.size:
            (length,) = HEADER.unpack_from(self.inbox)
            if len(self.inbox) < HEADER.size + length:
                break
            body = self.inbox[HEADER.size : HEADER.size + length]
            self.inbox = self.inbox[HEADER.size + length :]
            frames.append(json.loads(body))
        return frames


class HostLink:
    """The supervisor's frames to the host: through its own connection to the sandbox's
    door while it has one (made at the host's `proc.link`, relayed by the kernel; ended
    after a `proc.rest`, before each checkpoint, as gVisor cannot save a socket connected
    to the host), kept meanwhile and sent first on the next one."""

    def __init__(self) -> None:
        self.link: FramedLink | None = None
        self.kept: list[dict[str, Any]] = []

    def connect(self, path: str, token: str) -> FramedLink:
        """A new connection to the host at path, the old one closed (OSError: none)."""
        self.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        directory = -1
        try:
            sock.settimeout(5.0)
            if len(os.fsencode(path)) > 100:  # past a unix socket's room: through its dir
                directory = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
                path = f"/proc/self/fd/{directory}/{os.path.basename(path)}"
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        finally:
            if directory >= 0:
                os.close(directory)
        link = FramedLink(sock)
        link.send({**HELLO, "token": token})  # which proves it is the host's supervisor
        kept, self.kept = self.kept, []
        for message in kept:
            link.send(message)
        self.link = link
        return link

    def send(self, message: dict[str, Any]) -> None:
        """To the host now, or kept for the next connection (OSError: this one has gone)."""
        if self.link is None:
            self.kept.append(message)
        else:
            self.link.send(message)

    def close(self, flush: bool = False) -> None:
        """End the connection (with flush, once what waits is sent, for up to 5 s)."""
        link, self.link = self.link, None
        if link is None:
            return
        if flush and link.outbox:
            try:
                link.sock.settimeout(5.0)
                link.sock.sendall(link.outbox)
            except OSError:
                pass
        link.sock.close()
