"""An ASGI middleware that bounds request bodies, declared or streamed."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cloche.server.http.errors import BodyTooLarge, error_response


class BodyLimit:
    """Refuses bodies above max_bytes with 413, before or while they are read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0 or declared > self.max_bytes:
                    response = error_response(
                        413 if declared > 0 else 400,
                        "too_large" if declared > 0 else "invalid_request",
                        str(BodyTooLarge(self.max_bytes))
                        if declared > 0
                        else "invalid Content-Length",
                    )
                    await response(scope, receive, send)
                    return
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, bounded, send)
