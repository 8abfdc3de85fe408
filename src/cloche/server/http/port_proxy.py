"""One HTTP request carried to a server in a session, and its answer carried back, both
streamed (an upload goes on while it comes; a response's pieces go out as they come).

The request is written afresh (`cloche.network.ports.wire`): the headers of one hop, the
credentials cloche took (`Authorization`, the preview token and its cookie) and the client's
`X-Forwarded-*` are left out; the server sees itself at `localhost:PORT`, told where it is
served by `X-Forwarded-Host`, `-Proto` and (for path routes) `-Prefix`. The answer's
headers of one hop are dropped; on the API's own origin (path routes) its cookies are kept
to the port's path and the page gets `Content-Security-Policy: sandbox`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie
from typing import Any

from starlette.types import Receive, Scope, Send

from cloche.network.ports import wire
from cloche.network.ports.door import Link
from cloche.server.http import previews
from cloche.sessions.ports import PortTarget

log = logging.getLogger("cloche.ports")

# Request headers never passed on (besides those of one hop and those Connection names).
_NOT_PASSED = frozenset(
    {
        b"host",
        b"authorization",
        b"proxy-authorization",
        b"expect",
        b"content-length",
        b"x-forwarded-for",
        b"x-forwarded-host",
        b"x-forwarded-proto",
        b"x-forwarded-prefix",
        b"forwarded",
    }
)
# Response headers the front end writes itself (uvicorn's Date and Server), or frames.
_NOT_RETURNED = frozenset({b"content-length", b"date", b"server"})
SANDBOX_CSP = (b"content-security-policy", b"sandbox")


class ClientGone(Exception):
    """The client disconnected before the exchange was over."""


@dataclass
class Route:
    """Where a request came in: what the server inside is told, and what the answer needs."""

    port: int
    target: bytes  # the path and query the server sees
    host: bytes  # the Host the client named
    scheme: str  # http or https, as the client spoke
    prefix: str = ""  # a path route's: /v1/sessions/{id}/ports/{port}
    set_cookie: str | None = None  # a preview cookie to set with the answer
    extra: list[tuple[bytes, bytes]] = field(default_factory=list)

    @property
    def on_api_origin(self) -> bool:
        return bool(self.prefix)

    @property
    def origin(self) -> bytes:
        return self.scheme.encode() + b"://" + self.host


@dataclass
class Exchange:
    """What one request carried, for the metrics."""

    status: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


def request_headers(scope: Scope, route: Route) -> list[tuple[bytes, bytes]]:
    """The client's headers as the server inside gets them (without framing)."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    named = {
        part.strip().lower()
        for name, value in headers
        if name == b"connection"
        for part in value.split(b",")
    }
    out = [(b"host", b"localhost:%d" % route.port)]
    for name, value in headers:
        if name in wire.HOP_BY_HOP or name in _NOT_PASSED or name in named:
            continue
        if name == b"cookie":
            value = previews.without_preview_cookies(value.decode("latin-1")).encode("latin-1")
            if not value:
                continue
        elif name == b"referer" and previews.PARAMETER.encode() in value:
            value = _without_preview(value)
        elif name == b"origin" and value == route.origin:
            value = b"http://localhost:%d" % route.port  # same-origin, as the server sees it
        out.append((name, value))
    out.append((b"x-forwarded-host", route.host))
    out.append((b"x-forwarded-proto", route.scheme.encode()))
    if route.prefix:
        out.append((b"x-forwarded-prefix", route.prefix.encode()))
    client = scope.get("client")
    if client:
        out.append((b"x-forwarded-for", str(client[0]).encode()))
    return out + route.extra


def without_preview(query: bytes) -> bytes:
    """A query string without `cloche_preview` (the server never sees the token)."""
    name = previews.PARAMETER.encode()
    return b"&".join(p for p in query.split(b"&") if p and p.partition(b"=")[0] != name)


def _without_preview(url: bytes) -> bytes:
    base, question, query = url.partition(b"?")
    query, hash_, fragment = query.partition(b"#")
    kept = without_preview(query)
    return base + (b"?" + kept if kept else b"") + hash_ + fragment


def response_headers(
    head: wire.Head, frame: wire.Framing, route: Route
) -> list[tuple[bytes, bytes]]:
    """The server's headers as the client gets them."""
    named = head.tokens(b"connection")
    out = []
    for name, value in head.headers:
        if name in wire.HOP_BY_HOP or name in named or name in _NOT_RETURNED:
            continue
        if name == b"set-cookie":
            kept = _cookie_for(value, route)
            if kept is None:
                continue
            value = kept
        out.append((name, value))
    if frame.kind == "length":
        out.append((b"content-length", b"%d" % frame.length))
    if route.on_api_origin:
        out.append(SANDBOX_CSP)
    if route.set_cookie is not None:
        out.append((b"set-cookie", route.set_cookie.encode("latin-1")))
    return out


def _cookie_for(value: bytes, route: Route) -> bytes | None:
    """A cookie the server sets, as the client may get it: never one named as cloche's
    preview cookie; on the API's origin, kept to the port's path (no Domain)."""
    name = value.partition(b"=")[0].strip()
    if name == previews.COOKIE.encode():
        return None
    if not route.on_api_origin:
        return value
    try:
        cookie: SimpleCookie = SimpleCookie()
        cookie.load(value.decode("latin-1"))
    except CookieError:
        return None
    if len(cookie) != 1:
        return None
    morsel = next(iter(cookie.values()))
    morsel["domain"] = ""
    path = morsel["path"] or "/"
    morsel["path"] = route.prefix + (path if path.startswith("/") else "/" + path)
    return morsel.OutputString().encode("latin-1")


class _Client:
    """The client's side of an exchange: its body as it comes, then its leaving."""

    def __init__(self, receive: Receive, chunked: bool) -> None:
        self.receive = receive
        self.chunked = chunked
        self.body_done = False  # all of it was written to the server
        self.sent = 0  # bytes of it written

    async def pump(self, link: Link) -> None:
        """Write the rest of the body to the server as it comes, then wait for the client
        to leave: ClientGone (or a failed write's error) ends it."""
        while not self.body_done:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            data: bytes = message.get("body", b"")
            if data:
                self.sent += len(data)
                link.writer.write(wire.chunk(data) if self.chunked else data)
                await link.writer.drain()
            if not message.get("more_body", False):
                if self.chunked:
                    link.writer.write(wire.LAST_CHUNK)
                self.body_done = True
        while (await self.receive())["type"] != "http.disconnect":
            pass
        raise ClientGone


async def carry(
    scope: Scope, receive: Receive, send: Send, target: PortTarget, route: Route
) -> Exchange:
    """Carry one request and its answer (a 502 if the server's answer is not HTTP).

    Raises:
        PortUnreachable: nothing listens on the port (before anything was sent back).
        ClientGone: the client left before the answer began.
    """
    method: str = scope["method"]
    headers = request_headers(scope, route)
    framed = _body_framing(scope)
    if framed is not None:
        headers.append(framed)
    head = wire.request_head(method, route.target, headers)
    client = _Client(receive, framed == (b"transfer-encoding", b"chunked"))
    for attempt in (0, 1):
        link = await target.connect(head)
        pump = asyncio.ensure_future(client.pump(link))
        try:
            answer = await _answer(link, pump)
        except wire.BadResponse as exc:
            await _stop(pump)
            link.close()
            # A kept connection the server had closed meanwhile: once more, on a new one,
            # when there is no body (it can't be sent twice).
            if attempt == 0 and link.reused and framed is None:
                continue
            log.info("port %d: the server's answer was refused: %s", route.port, exc)
            return await bad_gateway(send, f"the server on port {route.port} {exc}")
        except BaseException:
            await _stop(pump)
            link.close()
            raise
        return await _stream(send, link, method, answer, pump, client, route)
    raise AssertionError("unreachable")  # pragma: no cover


def _body_framing(scope: Scope) -> tuple[bytes, bytes] | None:
    """How the request's body is framed to the server: as the client framed it."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return (b"content-length", value.strip())
    for name, _ in scope["headers"]:
        if name == b"transfer-encoding":
            return (b"transfer-encoding", b"chunked")
    return None


async def _stop(task: asyncio.Future[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _answer(link: Link, pump: asyncio.Future[None]) -> wire.Head:
    """The answer's head (interim 1xx answers skipped). Raises ClientGone if the client
    left first, or the error of a write to the server."""
    while True:
        reading = asyncio.ensure_future(wire.read_head(link.reader))
        either: list[asyncio.Future[Any]] = [reading, pump]
        done, _ = await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if reading not in done:
            await _stop(reading)
            pump.result()
        head = reading.result()
        if head.status >= 200:
            return head
        if head.status == 101:
            raise wire.BadResponse("switched protocols when asked for none")


async def _stream(
    send: Send,
    link: Link,
    method: str,
    head: wire.Head,
    pump: asyncio.Future[None],
    client: _Client,
    route: Route,
) -> Exchange:
    """Send the answer's head, then its body as it comes; keep the connection if the
    server does and all of the request was sent."""
    exchange = Exchange(status=head.status, bytes_in=client.sent)
    try:
        frame = wire.framing(head, method)
    except wire.BadResponse as exc:
        await _stop(pump)
        link.close()
        return await bad_gateway(send, f"the server on port {route.port} {exc}")
    complete = False
    pieces = wire.body(link.reader, frame)
    try:
        start = {"type": "http.response.start", "status": head.status}
        await send({**start, "headers": response_headers(head, frame, route)})
        while True:
            step = asyncio.ensure_future(anext(pieces, b""))
            either: list[asyncio.Future[Any]] = [step, pump]
            done, _ = await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if step not in done:  # the client left (or the server failed to take the body)
                await _stop(step)
                with contextlib.suppress(ClientGone, OSError):
                    pump.result()
                break
            data = step.result()
            if not data:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                complete = True
                break
            exchange.bytes_out += len(data)
            await send({"type": "http.response.body", "body": data, "more_body": True})
    finally:
        exchange.bytes_in = client.sent
        await pieces.aclose()
        await _stop(pump)
        if complete and client.body_done and wire.reusable(head, frame):
            link.keep()
        else:
            link.close()
    return exchange


def error_body(kind: str, message: str) -> bytes:
    """An error as the API answers it: {"error": {"type", "message"}}."""
    return json.dumps({"error": {"type": kind, "message": message}}, separators=(",", ":")).encode()


async def bad_gateway(send: Send, why: str) -> Exchange:
    body = error_body("port_unreachable", why)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 502, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    return Exchange(status=502)
