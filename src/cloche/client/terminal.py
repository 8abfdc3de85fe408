"""A terminal in a session (`session.pty()`): a login shell of the session's user (or a
command) on a pseudo-terminal, over the websocket `GET /v1/sessions/{id}/pty`.

Binary frames are the terminal's bytes both ways; a text frame `{"resize": {cols, rows}}`
resizes it; the server's text frame `{"exit": {exit_code, signal}}` tells the shell's end,
before it closes the socket. Closing the terminal hangs the shell up. A refusal closes the
socket with 4000 + the HTTP status the API would have answered, its reason the message:
raised from the first read or write as the tree's exception.

Example:
    async with await session.pty(cols=100, rows=30) as terminal:
        await terminal.write("echo $((6*7))\\n")
        print(await terminal.read(timeout=5))
"""

from __future__ import annotations

import asyncio
import json
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlencode

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from cloche.errors import (
    ClocheError,
    Forbidden,
    NotSupported,
    ProcessError,
    RequestTimeout,
    SandboxError,
    ServerUnreachable,
    SessionBusy,
    SessionLost,
    SessionNotFound,
    TooManySessions,
    Unauthorized,
    UnexpectedResponse,
)

MAX_FRAME_BYTES = 1 << 20  # of what the server sends at once (it sends pieces of output)
_REFUSALS: dict[int, type[ClocheError]] = {
    400: ProcessError,
    401: Unauthorized,
    403: Forbidden,
    409: SessionBusy,
    429: TooManySessions,
    501: NotSupported,
    503: SandboxError,
}


def terminal_url(url: str, session_id: str, cols: int, rows: int, cmd: str | None) -> str:
    """The websocket's address for a server's HTTP address."""
    scheme, _, rest = url.partition("://")
    query: dict[str, Any] = {"cols": cols, "rows": rows}
    if cmd:
        query["cmd"] = cmd
    ws = "wss" if scheme == "https" else "ws"
    return f"{ws}://{rest}/v1/sessions/{quote(session_id, safe='')}/pty?{urlencode(query)}"


def refusal(code: int, reason: str, session_id: str) -> ClocheError:
    """The exception for a socket closed with 4000 + an HTTP status."""
    status = code - 4000
    if status == 404 and "is not running" not in reason:
        return SessionNotFound(session_id)
    if status == 410:
        lost = SessionLost(session_id)
        lost.args = (reason or lost.args[0],)
        return lost
    kind = _REFUSALS.get(status)
    if kind is not None:
        return kind(reason or f"the terminal was refused (HTTP {status})")
    return UnexpectedResponse(f"the terminal was refused (HTTP {status}): {reason}", status)


class AsyncTerminal:
    """A terminal of a session; its shell runs until it exits or the terminal is closed."""

    def __init__(self, socket: ClientConnection, session_id: str) -> None:
        self.session_id = session_id
        self.exit_code: int | None = None  # once the shell exited by itself
        self.signal: str | None = None  # once a signal ended it
        self.ended = False  # the shell ended, or the socket closed
        self._socket = socket
        self._failure: ClocheError | None = None

    @classmethod
    async def open(
        cls,
        url: str,
        token: str | None,
        session_id: str,
        *,
        cols: int = 80,
        rows: int = 24,
        cmd: str | None = None,
        timeout_s: float = 60.0,
    ) -> AsyncTerminal:
        """Connect to a session's terminal socket.

        Raises:
            ServerUnreachable: nothing answers at url.
            RequestTimeout: the handshake took longer than timeout_s.
            UnexpectedResponse: url does not serve terminals (not cloche, or an old one).
        """
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        address = terminal_url(url, session_id, cols, rows, cmd)
        try:
            socket = await connect(
                address,
                additional_headers=headers,
                open_timeout=timeout_s,
                max_size=MAX_FRAME_BYTES,
                compression=None,  # keystrokes: no deflate's latency
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            raise UnexpectedResponse(
                f"{address} answered HTTP {status} instead of a terminal; is {url} a cloche "
                "server's HTTP port?",
                status,
            ) from exc
        except TimeoutError as exc:
            raise RequestTimeout(f"no terminal from {url} within {timeout_s:g} s") from exc
        except (OSError, WebSocketException) as exc:
            raise ServerUnreachable(f"can't open a terminal at {url}: {exc}") from exc
        return cls(socket, session_id)

    async def write(self, data: bytes | str) -> None:
        """Type into the terminal (text is sent as UTF-8).

        Raises:
            The refusal, when the terminal was refused; ProcessError once it has ended.
        """
        payload = data.encode() if isinstance(data, str) else bytes(data)
        try:
            await self._socket.send(payload)
        except ConnectionClosed as closed:
            self._closed(closed)
            raise self._failure or ProcessError("the terminal has ended") from None

    async def read(self, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        """The next bytes the terminal shows; b"" once it has ended (then `exit_code` and
        `signal` say how).

        Args:
            timeout: seconds to wait at most (None: until something comes).

        Raises:
            TimeoutError: nothing came within timeout (the terminal goes on).
            The refusal (SessionNotFound, Unauthorized, ...), when the terminal was refused.
        """
        while not self.ended:
            try:
                async with asyncio.timeout(timeout):
                    frame = await self._socket.recv()
            except ConnectionClosed as closed:
                self._closed(closed)
                break
            if isinstance(frame, bytes):
                return frame
            self._told(frame)
        if self._failure is not None:
            raise self._failure
        return b""

    def _told(self, text: str) -> None:
        """A text frame from the server: the shell's end (others are ignored)."""
        try:
            end = json.loads(text)["exit"]
        except (ValueError, KeyError, TypeError):
            return
        code, signal = end.get("exit_code"), end.get("signal")
        self.exit_code = code if isinstance(code, int) else None
        self.signal = signal if isinstance(signal, str) else None

    def _closed(self, closed: ConnectionClosed) -> None:
        self.ended = True
        received = closed.rcvd
        if received is not None and received.code >= 4000 and self._failure is None:
            self._failure = refusal(received.code, received.reason, self.session_id)

    async def resize(self, cols: int, rows: int) -> None:
        """Set the terminal's size (its programs get SIGWINCH)."""
        with_size = json.dumps({"resize": {"cols": int(cols), "rows": int(rows)}})
        try:
            await self._socket.send(with_size)
        except ConnectionClosed as closed:
            self._closed(closed)

    async def wait(self, timeout: float | None = None) -> int | None:  # noqa: ASYNC109
        """Read (and drop) what it shows until the shell ends; its exit code (None when a
        signal ended it, or the socket closed first).

        Raises:
            TimeoutError: still running after timeout.
        """
        async with asyncio.timeout(timeout):
            while await self.read():
                pass
        return self.exit_code

    async def close(self) -> None:
        """Close the terminal: its shell is hung up (SIGHUP, then SIGKILL after a grace).
        Idempotent."""
        await self._socket.close()
        self.ended = True

    async def __aenter__(self) -> AsyncTerminal:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncTerminal of session {self.session_id}>"
