"""The ASGI app and its uvicorn server, embedded in cloche's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cloche import __version__
from cloche.config import MIB, ServerConfig
from cloche.server import e2b, jupyter, ui
from cloche.server.collectors import merge
from cloche.server.events import EventBus
from cloche.server.http import (
    chat,
    cluster,
    commands,
    context,
    errors,
    events,
    history,
    packages,
    ports,
    profiles,
    sessions,
    snapshots,
    templates,
    terminals,
    terrarium,
    volumes,
)
from cloche.server.http.limits import BodyLimit
from cloche.server.http.port_routes import HostRoutes, PortRoutes
from cloche.server.http.previews import PreviewDomain
from cloche.server.http.websocket_writes import BatchedWebSocketProtocol
from cloche.server.mcp import http as mcp_http
from cloche.server.metrics import CONTENT_TYPE, Metrics
from cloche.server.signing import Signer
from cloche.server.tenants import Tenants
from cloche.sessions.manager import SessionManager

E2B_FILES_PATH = re.compile(r"^/e2b/files$")  # E2B's uploads: as large as a disk


def create_app(
    manager: SessionManager,
    config: ServerConfig,
    metrics: Metrics,
    tenants: Tenants | None = None,
) -> FastAPI:
    """The HTTP API over a session manager; tenants: the server's (by default, those
    config names)."""
    app = FastAPI(
        title="cloche",
        version=__version__,
        summary="Stateful Python sessions, each in its own gVisor sandbox",
        docs_url=None,  # served by the inspector's module, from the package (no CDN)
        redoc_url=None,
    )
    app.state.manager = manager
    app.state.broker = None  # the LLM broker (the RLM endpoint), set by the server
    app.state.metrics = metrics
    app.state.events = EventBus(config.events_buffer)  # the server's own, set by it
    app.state.tenants = tenants or Tenants.load(
        config.tokens_file, config.tokens, config.admin_tokens
    )
    app.state.limits = config.limits
    app.state.session_timeouts = {}
    app.state.background = set()
    # Preview tokens and the inspector's cookies are signed with the server's key.
    app.state.signer = Signer.of_data_dir(config.data_dir)
    domain = PreviewDomain.parse(config.preview_domain) if config.preview_domain else None
    app.state.hosts = HostRoutes(domain)  # host routes; ports other front ends serve there
    app.state.websocket_max_bytes = config.max_frame_bytes
    errors.install(app)
    app.include_router(terrarium.router)
    app.include_router(sessions.router)
    app.include_router(commands.router)
    app.include_router(terminals.router)
    app.include_router(ports.router)
    app.include_router(history.router)
    app.include_router(snapshots.router)
    app.include_router(context.router)
    app.include_router(packages.router)
    app.include_router(profiles.router)
    app.include_router(templates.router)
    app.include_router(volumes.router)
    app.include_router(chat.router)
    app.include_router(cluster.router)
    app.include_router(events.router)
    jupyter.mount(app, manager)  # the Jupyter kernel gateway: /api
    ui.mount(app)  # the inspector (/ui) and the API's docs (/docs)
    e2b.mount(app, manager, config.limits)  # E2B's SDKs: /e2b (server/e2b)

    @app.get("/health", summary="200 while sandboxes can be served, else 503")
    async def health() -> JSONResponse:
        if manager.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics_endpoint(request: Request) -> Response:
        nodes = await manager.node_metrics()  # a cluster's nodes, each labelled `node`
        text = merge(metrics.render(), nodes) if nodes else metrics.render()
        return Response(text, media_type=CONTENT_TYPE)

    mcp_http.mount(app, config)  # MCP's streamable HTTP transport at /mcp
    app.add_middleware(
        BodyLimit,
        max_bytes=config.max_frame_bytes,
        larger=[
            (context.PATH, config.limits.disk_mib * MIB),
            (sessions.UPLOAD_PATH, config.limits.disk_mib * MIB),
            (templates.UPLOAD_PATH, config.template_max_mib * MIB),
            (E2B_FILES_PATH, config.limits.disk_mib * MIB),
            (volumes.UPLOAD_PATH, config.volume_max_mib * MIB),
        ],
    )
    # Outermost (added last): port routes are served before the API's limits and routes.
    app.add_middleware(PortRoutes, api=app)
    return app


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside our own event loop: signals are the host server's business."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HTTPFrontEnd:
    """Serves the app on --http-port."""

    def __init__(
        self,
        manager: SessionManager,
        config: ServerConfig,
        metrics: Metrics,
        tenants: Tenants | None = None,
    ) -> None:
        self.app = create_app(manager, config, metrics, tenants)
        self.sock = socket.create_server((config.host, config.http_port))
        # Accepted connections inherit this (Linux). asyncio would set it on each, but skips
        # sockets whose proto is 0, as create_server's are; without it, uvicorn's headers
        # and body go out as two writes, and Nagle holds the body ~40 ms for the client's
        # delayed ACK, on every request of a kept-alive connection.
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.port: int = self.sock.getsockname()[1]
        uvicorn_config = uvicorn.Config(
            self.app,
            # httptools (C) parses HTTP for ~25% less of the server's CPU per request than
            # h11 (pure Python): measured per sessions-API cell, BENCHMARKS.md.
            http="httptools",
            log_level="warning",
            access_log=False,
            proxy_headers=False,  # served directly; nothing here reads forwarded headers
            lifespan="on",  # runs MCP's session manager
            timeout_keep_alive=30,
            limit_concurrency=config.max_connections,
            # The Jupyter gateway's websockets, a turn's frames in one write: a larger
            # message is refused with 1009.
            ws=BatchedWebSocketProtocol,
            ws_max_size=config.max_frame_bytes,
            # Small JSON messages, mostly on a LAN or loopback: compressing each cost ~7% of
            # the server's CPU with 100 busy kernels (py-spy), for nothing.
            ws_per_message_deflate=False,
        )
        self.server = _EmbeddedServer(uvicorn_config)

    async def serve(self) -> None:
        await self.server.serve(sockets=[self.sock])

    async def stop(self) -> None:
        self.server.should_exit = True
        self.app.state.mcp.stop()  # its open streams end, so connections can drain
        await self.app.state.e2b.stop()
        background: set[asyncio.Task[None]] = self.app.state.background
        await asyncio.gather(*background, return_exceptions=True)
