"""Ports served to clients: requests routed to a server in a session before the API sees them.

Two routes reach port P of session S:
- the path route, `ANY /v1/sessions/S/ports/P/{path}` (websockets too), on the API's own
  origin: its pages get `Content-Security-Policy: sandbox`; `/ports/P` redirects to
  `/ports/P/`;
- the host route, `http://P-S.{--preview-domain}/{path}`, for apps that must live at `/`:
  every request to such a host goes to the port (never to the API), and a host of the domain
  that names no port is a 404.

Auth comes first: the owner's bearer token, as the API takes it; or a preview token
(`?cloche_preview=T`, or the cookie it sets) for exactly S and P. No credentials, a wrong or
expired preview token: 401; another tenant's token, another session's or port's preview
token: 404 (the session is not theirs to see); never the app's answer.

The seam for other front ends (E2B's): `HostRoutes.claim(port, app)` hands the host-routed
requests for a port (`{port}-{id}.{domain}`) to an ASGI app of theirs, which does its own
auth, with `scope["cloche.port"] = {"session_id", "port"}`; and `port_app(manager, session
id, port, owner)` is an ASGI app that serves any request to that port of that session, for
a front end that has checked its caller itself.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import parse_qsl

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cloche.errors import ClocheError, PortUnreachable, SessionNotFound, Unauthorized
from cloche.server.http import port_proxy, port_websockets, previews
from cloche.server.http.errors import status_of
from cloche.server.http.port_proxy import ClientGone, Exchange, Route
from cloche.server.http.previews import PreviewDomain
from cloche.server.signing import Signer
from cloche.server.tenants import Tenants
from cloche.sessions.manager import SessionManager
from cloche.sessions.ports import Owner

log = logging.getLogger("cloche.ports")

_PATH = re.compile(rb"^/v1/sessions/([^/]+)/ports/([^/]+)(/.*)?$", re.DOTALL)
_SESSION_ID = re.compile(rb"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_PORT = re.compile(rb"^[1-9][0-9]{0,4}$")
PORT_SCOPE_KEY = "cloche.port"  # {"session_id", "port"}, for a claimed port's app
WEBSOCKET_MAX_BYTES = 16 << 20  # a message from a server inside, at most (as --max-frame-bytes)
_DENIAL = "websocket.http.response"  # the ASGI extension: a refusal with a body


class HostRoutes:
    """The hosts ports are served at (--preview-domain), and the ports another front end
    serves itself there."""

    def __init__(self, domain: PreviewDomain | None) -> None:
        self.domain = domain
        self._claimed: dict[int, ASGIApp] = {}

    def claim(self, port: int, app: ASGIApp) -> None:
        """Hand the host-routed requests for port to app (which does its own auth); the
        session and port are in `scope["cloche.port"]`."""
        self._claimed[port] = app

    def claimed(self, port: int) -> ASGIApp | None:
        return self._claimed.get(port)


class PortRoutes:
    """ASGI middleware in front of the API: port routes are served here, the rest passes."""

    def __init__(self, app: ASGIApp, api: FastAPI) -> None:
        self.app = app
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        hosts: HostRoutes = self.api.state.hosts
        if hosts.domain is not None:
            named = [value for name, value in scope["headers"] if name == b"host"]
            if len(named) > 1:  # which one routes? neither (RFC 9112 3.2)
                await _answer(scope, send, 400, "invalid_request", "a request names one Host")
                return
            host = named[0] if named else b""
            found = hosts.domain.match(host.decode("latin-1"))
            if found is True:
                await _refuse(scope, send, SessionNotFound("no port of a session at this host"))
                return
            if isinstance(found, tuple):
                port, session_id = found
                claimed = hosts.claimed(port)
                if claimed is not None:
                    scope = {**scope, PORT_SCOPE_KEY: {"session_id": session_id, "port": port}}
                    await claimed(scope, receive, send)
                    return
                raw = scope.get("raw_path") or scope["path"].encode()
                route = Route(port, _target(raw, scope), host, hosts.domain.scheme)
                await self._serve(scope, receive, send, session_id, route, "/")
                return
        raw = scope.get("raw_path") or scope["path"].encode()
        match = _PATH.match(raw)
        if match is None or not _SESSION_ID.match(match[1]) or not _PORT.match(match[2]):
            await self.app(scope, receive, send)
            return
        rest = match[3]
        if rest == b"/url" and scope["type"] == "http" and scope["method"] == "POST":
            await self.app(scope, receive, send)  # the API's: a preview URL
            return
        session_id, port = match[1].decode(), int(match[2])
        if port > 65535:
            await self.app(scope, receive, send)
            return
        prefix = f"/v1/sessions/{session_id}/ports/{port}"
        route = Route(
            port,
            _target(rest or b"/", scope),
            _header(scope, b"host") or b"",
            str(scope.get("scheme", "http")).replace("ws", "http"),
            prefix=prefix,
        )
        await self._serve(scope, receive, send, session_id, route, prefix + "/", rest is None)

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        session_id: str,
        route: Route,
        cookie_path: str,
        redirect: bool = False,
    ) -> None:
        kind = "websocket" if scope["type"] == "websocket" else "http"
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        exchange = Exchange()
        try:
            owner, preview = self._owner(scope, session_id, route.port)
            if redirect:
                exchange = await _redirect(scope, send)
                return
            if preview is not None:
                token, expires_at = preview
                secure = route.scheme == "https"
                route.set_cookie = previews.set_cookie(token, expires_at, cookie_path, secure)
            manager: SessionManager = self.api.state.manager
            async with manager.reach_port(session_id, route.port, owner) as target:
                if kind == "http":
                    exchange = await port_proxy.carry(scope, receive, tracked, target, route)
                else:
                    size = self.api.state.websocket_max_bytes
                    exchange = await port_websockets.bridge(
                        scope, receive, tracked, target, route, size
                    )
        except ClientGone:
            pass
        except ClocheError as exc:
            if started:
                raise
            exchange.status = await _refuse(scope, send, exc)
            self.api.state.metrics.rejected.labels("http", status_of(exc)[1]).inc()
        except (ConnectionError, TimeoutError) as exc:  # the server's side broke off
            if not started:
                broke = PortUnreachable(f"the server on port {route.port} broke off")
                exchange.status = await _refuse(scope, send, broke)
            log.info("port %d of session %s: %s", route.port, session_id, exc or type(exc))
        finally:
            self.api.state.metrics.port_exchange(
                kind, exchange.status, exchange.bytes_in, exchange.bytes_out
            )

    def _owner(
        self, scope: Scope, session_id: str, port: int
    ) -> tuple[Owner, tuple[str, float] | None]:
        """Who asks (and a preview token given in the query, to keep as a cookie).

        Raises:
            Unauthorized: no credentials the server takes.
            SessionNotFound: a preview token for another session or port.
        """
        tenants: Tenants = self.api.state.tenants
        signer: Signer = self.api.state.signer
        scheme, _, credentials = (_header(scope, b"authorization") or b"").partition(b" ")
        if scheme.lower() == b"bearer":
            caller = tenants.caller(credentials.strip().decode("latin-1"))
            if caller is None:
                raise Unauthorized("not a token of this server's (nor is a preview token one)")
            return caller.token, None
        query = scope.get("query_string", b"").decode("latin-1")
        given = [v for k, v in parse_qsl(query, keep_blank_values=True) if k == previews.PARAMETER]
        if given:
            owner, expires_at = previews.owner_of(signer, given[0], session_id, port)
            return owner, (given[0], expires_at)
        kept = previews.cookie_tokens((_header(scope, b"cookie") or b"").decode("latin-1"))
        refusal: ClocheError | None = None
        for token in kept:
            try:
                return previews.owner_of(signer, token, session_id, port)[0], None
            except SessionNotFound as exc:  # another session's: the answer, unless one fits
                refusal = exc
            except Unauthorized as exc:
                refusal = refusal or exc
        if refusal is not None:
            raise refusal
        anyone = tenants.caller(None)
        if anyone is None:
            raise Unauthorized(
                "this port needs the session owner's 'Authorization: Bearer <token>', or a "
                "preview token (POST /v1/sessions/{id}/ports/{port}/url makes one)"
            )
        return anyone.token, None


def port_app(
    manager: SessionManager,
    session_id: str,
    port: int,
    owner: Owner,
    websocket_max_bytes: int = WEBSOCKET_MAX_BYTES,
) -> ASGIApp:
    """An ASGI app that serves any request (HTTP or websocket) to a port of a session, for a
    front end that has checked its caller itself: what serves (session id, port)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        host = _header(scope, b"host") or b""
        raw = scope.get("raw_path") or scope["path"].encode()
        route = Route(port, _target(raw, scope), host, str(scope.get("scheme", "http")))
        async with manager.reach_port(session_id, port, owner) as target:
            try:
                if scope["type"] == "websocket":
                    await port_websockets.bridge(
                        scope, receive, send, target, route, websocket_max_bytes
                    )
                else:
                    await port_proxy.carry(scope, receive, send, target, route)
            except ClientGone:
                pass

    return app


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _target(path: bytes, scope: Scope) -> bytes:
    """The path and query the server inside sees (the preview token left out)."""
    query = port_proxy.without_preview(scope.get("query_string", b""))
    return path + (b"?" + query if query else b"")


async def _redirect(scope: Scope, send: Send) -> Exchange:
    """/ports/{port} to /ports/{port}/ (the app's relative links then work)."""
    raw = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string", b"")
    location = raw + b"/" + (b"?" + query if query else b"")
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return Exchange(status=404)
    await send(
        {
            "type": "http.response.start",
            "status": 308,
            "headers": [(b"location", location), (b"content-length", b"0")],
        }
    )
    await send({"type": "http.response.body", "body": b""})
    return Exchange(status=308)


async def _refuse(scope: Scope, send: Send, exc: ClocheError) -> int:
    """cloche's own answer, as the API gives it (the app is never asked)."""
    status, kind = status_of(exc)
    return await _answer(scope, send, status, kind, str(exc))


async def _answer(scope: Scope, send: Send, status: int, kind: str, message: str) -> int:
    body = port_proxy.error_body(kind, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if scope["type"] == "websocket":
        if _DENIAL in (scope.get("extensions") or {}):
            await send(
                {"type": "websocket.http.response.start", "status": status, "headers": headers}
            )
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008})
        return status
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    return status
