"""MCP's streamable HTTP transport at /mcp on the server's HTTP port.

The tools call the server's session manager directly (`direct.py`), as the caller: its
bearer token is checked here first, exactly as the API checks it, and passed to the
manager as the owner, so sessions it makes belong to it. A connection is an MCP session
(the Mcp-Session-Id header); the session it gets is closed when the client ends it
(DELETE /mcp). Clients of the stateless 2026 protocol have no connection: their calls
without a session_id run in one-off sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from mcp.server.mcpserver import Context
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from cloche.config import Limits, ServerConfig
from cloche.errors import Unauthorized
from cloche.server.http.auth import bearer_owner
from cloche.server.http.errors import error_response
from cloche.server.http.ports import make_preview
from cloche.server.mcp.direct import ManagerClient
from cloche.server.mcp.surface import Scope as ToolScope
from cloche.server.mcp.tools import ConnectionSessions, build_server
from cloche.server.tenants import Tenants
from cloche.sessions.manager import SessionManager

log = logging.getLogger("cloche.mcp")
PATH = "/mcp"
SESSION_HEADER = "mcp-session-id"


def _bearer(headers: Any) -> str | None:
    scheme, _, token = str(headers.get("authorization", "")).partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class ManagerScope(ToolScope):
    """Tools call the session manager of the app they are mounted on, as the MCP caller's
    token."""

    def __init__(self, app: FastAPI) -> None:
        self._app = app
        self._manager: SessionManager = app.state.manager
        self._limits: Limits = app.state.limits
        self._timeouts: dict[str, float] = app.state.session_timeouts
        self._tenants: Tenants = app.state.tenants

    def _token(self, ctx: Context) -> str | None:
        caller = self._tenants.caller(_bearer(ctx.headers or {}))
        return caller.token if caller is not None else None  # the gate let only these through

    def client(self, ctx: Context) -> ManagerClient:
        base_url = f"http://{(ctx.headers or {}).get('host', '127.0.0.1')}"

        async def previews(
            session_id: str, port: int, owner: str | None, ttl_s: int
        ) -> tuple[str, str]:
            return await make_preview(self._app, session_id, port, owner, ttl_s, base_url)

        token = self._token(ctx)
        return ManagerClient(self._manager, token, self._limits, self._timeouts, previews)

    def connection(self, ctx: Context) -> str | None:
        return connection_key(ctx.headers or {}, self._token(ctx))


def connection_key(headers: Any, token: str | None) -> str | None:
    """The caller's MCP session id, tied to its token (a hash: keys show up in logs)."""
    mcp_session = headers.get(SESSION_HEADER)
    if not mcp_session:
        return None
    owner = hashlib.sha256(token.encode()).hexdigest()[:12] if token else "-"
    return f"{owner}/{mcp_session}"


class MCPEndpoint:
    """The ASGI endpoint of /mcp: tokens, MCP's session manager, and connections' ends."""

    def __init__(self, app: FastAPI, config: ServerConfig) -> None:
        self.sessions = ConnectionSessions()
        self.scope = ManagerScope(app)
        self.server = build_server(self.scope, self.sessions)
        # Makes the session manager (the Starlette app it returns is not used: /mcp is
        # routed here). DNS-rebinding protection is on when the server listens on loopback.
        self.server.streamable_http_app(
            streamable_http_path=PATH,
            host=config.host,
            max_request_body_size=config.max_frame_bytes,
        )
        self.manager = self.server.session_manager
        self._stopping = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        try:
            token = bearer_owner(request)
        except Unauthorized as exc:
            await error_response(401, "unauthorized", str(exc), PATH)(scope, receive, send)
            return
        if self._stopping.is_set():
            await error_response(503, "unavailable", "the server is stopping", PATH)(
                scope, receive, send
            )
            return
        ending = connection_key(request.headers, token) if scope["method"] == "DELETE" else None

        async def answer(message: Message) -> None:
            # The client ended its MCP session: close its cloche session before saying so.
            if ending and message["type"] == "http.response.start" and message["status"] < 300:
                await self.sessions.close(ending)
            await send(message)

        await self.manager.handle_request(scope, self._until_stopped(receive), answer)

    def _until_stopped(self, receive: Receive) -> Callable[[], Any]:
        """receive(), but a disconnect once the server stops: open streams end, so uvicorn
        can drain its connections."""

        async def receive_or_disconnect() -> Message:
            if self._stopping.is_set():
                return {"type": "http.disconnect"}
            waiting = asyncio.ensure_future(receive())
            stopping = asyncio.ensure_future(self._stopping.wait())
            try:
                await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
            if waiting.done():
                return waiting.result()
            waiting.cancel()
            return {"type": "http.disconnect"}

        return receive_or_disconnect

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """MCP's session manager, for the app's lifespan; connections' sessions closed after."""
        async with self.manager.run():
            try:
                yield
            finally:
                await self.sessions.close_all()
                _stop_sse_watcher()

    def stop(self) -> None:
        """End open MCP streams and refuse new requests (the server is going down)."""
        self._stopping.set()


def _stop_sse_watcher() -> None:
    """End the task sse_starlette (MCP's SSE responses) leaves polling on each event loop.

    It waits for a uvicorn signal handler to say the server is exiting, and the embedded
    server installs none; `MCPEndpoint.stop` ends the streams instead. Left running, it
    outlives the server and is destroyed pending when its loop closes.
    """
    for task in asyncio.all_tasks():
        code = getattr(task.get_coro(), "cr_code", None)
        if code is not None and code.co_name == "_shutdown_watcher":
            if "sse_starlette" in code.co_filename:
                task.cancel()


def mount(app: FastAPI, config: ServerConfig) -> MCPEndpoint:
    """Serve MCP at /mcp on `app`, started and stopped with the app's lifespan."""
    endpoint = MCPEndpoint(app, config)
    app.router.routes.append(Route(PATH, endpoint=endpoint, include_in_schema=False))
    previous = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(started: Any) -> AsyncIterator[Any]:
        async with previous(started) as state, endpoint.running():
            yield state

    app.router.lifespan_context = lifespan
    app.state.mcp = endpoint
    return endpoint
