"""A small blocking client for the original REPL TCP protocol (see the tcp-protocol spec)."""

from __future__ import annotations

import socket
from types import TracebackType
from typing import Any

from cloche.errors import IncompleteRead
from cloche.protocol.framing import HEADER, decode_body, encode_frame


class TCPClient:
    """One connection to a cloche (or original REPL) server.

    Example:
        with TCPClient("127.0.0.1", 8000) as client:
            reply = client.run("x = 1\\nx + 1")       # a new session
            client.run("x", session_id=reply["session_id"])
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = 8000, *, timeout_s: float | None = 120.0
    ) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.greeting = self.receive()

    def run(
        self,
        code: str,
        session_id: str | None = None,
        *,
        timeout_s: float | None = None,
        token: str | None = None,
    ) -> dict[str, Any]:
        """Run code (in a new session when session_id is None); the server's reply."""
        request: dict[str, Any] = {"code": code}
        if session_id is not None:
            request["session_id"] = session_id
        if timeout_s is not None:
            request["timeout"] = timeout_s
        if token is not None:
            request["token"] = token
        return self.request(request)

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send any JSON object as a frame and read the reply."""
        self.sock.sendall(encode_frame(message))
        return self.receive()

    def receive(self) -> dict[str, Any]:
        (length,) = HEADER.unpack(self._read_exactly(HEADER.size))
        return decode_body(self._read_exactly(length))

    def _read_exactly(self, count: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < count:
            chunk = self.sock.recv(count - len(chunks))
            if not chunk:
                raise IncompleteRead(f"connection closed after {len(chunks)} of {count} bytes")
            chunks += chunk
        return bytes(chunks)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> TCPClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
