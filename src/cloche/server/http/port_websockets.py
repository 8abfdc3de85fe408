"""A websocket carried to a server in a session: the client's handshake is answered by
cloche's front end, the server's by cloche as a client of it (`websockets`' protocol, no
I/O of its own), and messages cross between the two, text as text and binary as binary.

The subprotocols the client offers are offered to the server; the one the server picks is
the one the client gets. A server that refuses the handshake has its answer passed on
(its status, headers and body), where the front end can send one. Either side's close
(code and reason) is passed to the other; pings are answered on each side by its own end.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from starlette.types import Receive, Scope, Send
from websockets.client import ClientProtocol
from websockets.exceptions import InvalidState
from websockets.frames import Close, CloseCode, Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from cloche.network.ports.door import Link
from cloche.server.http.port_proxy import Exchange, Route, error_body, request_headers
from cloche.sessions.ports import PortTarget

READ_BYTES = 256 * 1024
# The handshake's own headers: made by the protocol, never the client's.
_HANDSHAKE = frozenset(
    {
        b"host",
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-protocol",
        b"sec-websocket-extensions",
    }
)
_HANDSHAKE_TIMEOUT_S = 30.0
_DENIAL = "websocket.http.response"  # the ASGI extension: a refusal with a body


class _ServerGone(Exception):
    """The server's side ended (its close frame, or the connection)."""


async def bridge(
    scope: Scope, receive: Receive, send: Send, target: PortTarget, route: Route, max_bytes: int
) -> Exchange:
    """Carry a websocket to the port until either side closes it."""
    if (await receive())["type"] != "websocket.connect":
        return Exchange()
    offered = [Subprotocol(p) for p in scope.get("subprotocols") or []]
    protocol = ClientProtocol(
        parse_uri(f"ws://localhost:{route.port}/"),
        subprotocols=offered or None,
        max_size=max_bytes,
    )
    request = protocol.connect()
    request.path = route.target.decode("ascii")
    for name, value in request_headers(scope, route):
        if name not in _HANDSHAKE:
            request.headers[name.decode("latin-1")] = value.decode("latin-1")
    protocol.send_request(request)
    link = await target.connect(b"".join(protocol.data_to_send()))
    exchange = Exchange()
    try:
        response, early = await _handshake(link, protocol)
        if protocol.state is not State.OPEN:
            exchange.status = response.status_code if response is not None else 502
            await _refuse(scope, send, response, route)
            return exchange
        exchange.status = 101
        headers = [(b"set-cookie", c.encode("latin-1")) for c in _cookies(response, route)]
        await send(
            {"type": "websocket.accept", "subprotocol": protocol.subprotocol, "headers": headers}
        )
        await _both_ways(receive, send, link, protocol, early, exchange)
        return exchange
    finally:
        link.close()


async def _handshake(link: Link, protocol: ClientProtocol) -> tuple[Response | None, list[Any]]:
    """The server's answer to the handshake (None: it closed without one), and the frames
    that came with it."""
    async with asyncio.timeout(_HANDSHAKE_TIMEOUT_S):
        while protocol.state is State.CONNECTING and protocol.handshake_exc is None:
            data = await link.reader.read(READ_BYTES)
            if not data:
                protocol.receive_eof()
                break
            protocol.receive_data(data)
    events = protocol.events_received()
    response = next((e for e in events if isinstance(e, Response)), None)
    return response, [e for e in events if e is not response]


def _cookies(response: Response | None, route: Route) -> list[str]:
    found = [] if response is None else response.headers.get_all("Set-Cookie")
    if route.on_api_origin:
        found = []  # a page on the API's origin sets none (its path is the API's)
    if route.set_cookie is not None:
        found.append(route.set_cookie)
    return found


async def _refuse(scope: Scope, send: Send, response: Response | None, route: Route) -> None:
    """The server did not take the websocket: its answer, as far as ASGI can tell it."""
    if _DENIAL not in (scope.get("extensions") or {}):
        await send({"type": "websocket.close", "code": CloseCode.INTERNAL_ERROR})
        return
    if response is None:
        status = 502
        body = error_body("port_unreachable", f"the server on port {route.port} did not answer")
        headers = [(b"content-type", b"application/json")]
    else:
        status, body = response.status_code, bytes(response.body or b"")
        headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in response.headers.raw_items()
            if k.lower() in ("content-type", "www-authenticate", "location", "retry-after")
        ]
    await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


async def _both_ways(
    receive: Receive,
    send: Send,
    link: Link,
    protocol: ClientProtocol,
    early: list[Any],
    exchange: Exchange,
) -> None:
    """Messages both ways until either side closes."""

    def flush() -> None:
        for data in protocol.data_to_send():
            if data:
                link.writer.write(data)
            elif link.writer.can_write_eof():
                link.writer.write_eof()

    async def from_client() -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                code = message.get("code") or CloseCode.NORMAL_CLOSURE
                with contextlib.suppress(InvalidState, ValueError):
                    if code in (1005, 1006, 1015) or not 1000 <= code < 5000:
                        protocol.send_close()
                    else:
                        protocol.send_close(code, str(message.get("reason") or ""))
                flush()
                return
            text, data = message.get("text"), message.get("bytes")
            if text is not None:
                encoded = text.encode()
                exchange.bytes_in += len(encoded)
                protocol.send_text(encoded)
            elif data is not None:
                exchange.bytes_in += len(data)
                protocol.send_binary(data)
            flush()
            await link.writer.drain()

    async def from_server() -> None:
        parts: list[bytes] = []
        kind = Opcode.BINARY
        pending = early
        while True:
            for event in [*pending, *protocol.events_received()]:
                if not isinstance(event, Frame):
                    continue
                if event.opcode is Opcode.CLOSE:
                    close = Close.parse(event.data) if event.data else None
                    await send(
                        {
                            "type": "websocket.close",
                            "code": close.code if close else CloseCode.NORMAL_CLOSURE,
                            "reason": close.reason if close else "",
                        }
                    )
                    flush()
                    raise _ServerGone
                if event.opcode in (Opcode.TEXT, Opcode.BINARY):
                    kind, parts = event.opcode, [bytes(event.data)]
                elif event.opcode is Opcode.CONT:
                    parts.append(bytes(event.data))
                else:
                    continue  # a ping (answered by the protocol) or a pong
                if event.fin:
                    payload = b"".join(parts)
                    parts = []
                    exchange.bytes_out += len(payload)
                    if kind is Opcode.TEXT:
                        await send({"type": "websocket.send", "text": payload.decode()})
                    else:
                        await send({"type": "websocket.send", "bytes": payload})
            pending = []
            flush()
            if protocol.state is State.CLOSED:
                raise _ServerGone
            data = await link.reader.read(READ_BYTES)
            if not data:
                protocol.receive_eof()
                if not protocol.events_received():
                    await send({"type": "websocket.close", "code": CloseCode.GOING_AWAY})
                    raise _ServerGone
            else:
                protocol.receive_data(data)

    sides = [asyncio.ensure_future(from_client()), asyncio.ensure_future(from_server())]
    try:
        await asyncio.wait(sides, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for side in sides:
            side.cancel()
        await asyncio.gather(*sides, return_exceptions=True)
