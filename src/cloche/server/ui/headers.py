"""The headers every response of the inspector carries: a strict Content-Security-Policy
(no inline script or style, nothing from elsewhere, no framing), no MIME sniffing, no
Referer. A response that sets its own policy keeps it (the terminal's page: `terminal.py`)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",  # plots come as data: URLs
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
        "frame-src 'self'",  # HTML outputs: srcdoc frames, sandboxed
    )
)
HEADERS = (
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)


class SecurityHeaders:
    """Adds `HEADERS` to every response of the app it wraps."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                own = any(name.lower() == HEADERS[0][0] for name, _ in headers)
                message["headers"] = [*headers, *(HEADERS[1:] if own else HEADERS)]
            await send(message)

        await self.app(scope, receive, send_with_headers)
