"""An ASGI middleware that bounds request bodies, declared or streamed."""

from __future__ import annotations

import re
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cloche.server.http.errors import BodyTooLarge, error_response

# A body declared too large is still read and dropped up to this size before the 413, so
# that a client that sends it whole before reading gets the answer, not a reset (a socket
# closed with unread data resets the connection). Past it, the server answers and closes.
DRAIN_MAX_BYTES = 64 * 1024 * 1024


class BodyLimit:
    """Refuses bodies above max_bytes with 413, before or while they are read.

    `larger` gives other limits to the paths that match (streamed uploads).
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, larger: Sequence[tuple[re.Pattern[str], int]] = ()
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = tuple(larger)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = next(
            (limit for path, limit in self.larger if path.match(scope.get("path", ""))),
            self.max_bytes,
        )
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0 or declared > max_bytes:
                    if 0 < declared <= DRAIN_MAX_BYTES:
                        await _drain(receive)
                    response = error_response(
                        413 if declared > 0 else 400,
                        "too_large" if declared > 0 else "invalid_request",
                        str(BodyTooLarge(max_bytes)) if declared > 0 else "invalid Content-Length",
                        scope.get("path"),
                    )
                    await response(scope, receive, send)
                    return
        received = 0
        too_large = False

        async def bounded() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    too_large = True
                    raise BodyTooLarge(max_bytes)
            return message

        async def answer(message: Message) -> None:
            # Whoever caught BodyTooLarge (FastAPI turns it into a 400 "error parsing the
            # body" when it reads a JSON body), the client is told 413.
            if not too_large:
                await send(message)
            elif message["type"] == "http.response.start":
                exc = BodyTooLarge(max_bytes)
                await error_response(413, "too_large", str(exc), scope.get("path"))(
                    scope, receive, send
                )

        await self.app(scope, bounded, answer)


async def _drain(receive: Receive) -> None:
    """Read the request's body to its end (bounded by its declared length), keeping none."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
