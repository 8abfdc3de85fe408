"""The HTTP front end (an ASGI app on uvicorn). For now: GET /health."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from cloche.sessions.manager import SessionManager


def create_app(manager: SessionManager) -> FastAPI:
    app = FastAPI(title="cloche", summary="A gVisor-isolated, stateful Python sandbox")

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the server can run code (pool warm or sandboxes startable), else 503."""
        if manager.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    return app


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside our own event loop: signals are the host server's business."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HTTPFrontEnd:
    def __init__(self, manager: SessionManager, host: str, port: int) -> None:
        self.app = create_app(manager)
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port: int = self.sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self.server = _EmbeddedServer(config)

    async def serve(self) -> None:
        await self.server.serve(sockets=[self.sock])

    def stop(self) -> None:
        self.server.should_exit = True
