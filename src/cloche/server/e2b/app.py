"""The E2B front end's ASGI app: the control plane, envd and the code interpreter, routed."""

from __future__ import annotations

from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process.process_connect import ProcessASGIApplication
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from cloche.config import Limits
from cloche.server.e2b import files
from cloche.server.e2b.control import ControlPlane, no_route
from cloche.server.e2b.errors import error_json
from cloche.server.e2b.filesystem import FilesystemService
from cloche.server.e2b.interpreter import Interpreter
from cloche.server.e2b.process import ProcessService
from cloche.server.e2b.routing import CODECS, ENVD_PORT, INTERPRETER_PORT, Reach
from cloche.server.e2b.sandboxes import Sandboxes
from cloche.sessions.manager import SessionManager

READ_MAX_BYTES = 16 * 1024 * 1024  # one Connect message (a command line with its input)


class E2B:
    """The front end's state and its ASGI app (mounted at PREFIX)."""

    def __init__(self, manager: SessionManager, limits: Limits) -> None:
        self.sandboxes = Sandboxes(manager)
        self.reach = Reach(manager, self.sandboxes)
        self.control = ControlPlane(manager, self.sandboxes, limits)
        self.process = ProcessASGIApplication(
            ProcessService(self.reach), read_max_bytes=READ_MAX_BYTES, codecs=CODECS
        )
        self.filesystem = FilesystemASGIApplication(
            FilesystemService(self.reach), read_max_bytes=READ_MAX_BYTES, codecs=CODECS
        )
        reach = self.reach
        interpreter = Interpreter(reach)

        async def health(request: Request) -> Response:
            return await files.health(reach, request)

        async def download(request: Request) -> Response:
            return await files.download(reach, request)

        async def upload(request: Request) -> Response:
            return await files.upload(reach, request)

        self.envd_http = Router(
            [
                Route("/health", health, methods=["GET"]),
                Route("/files", download, methods=["GET"]),
                Route("/files", upload, methods=["POST"]),
            ],
            default=no_route,
        )
        self.interpreter = Router(
            [
                Route("/health", health, methods=["GET"]),
                Route("/execute", interpreter.execute, methods=["POST"]),
                Route("/contexts", interpreter.create_context, methods=["POST"]),
                Route("/contexts", interpreter.list_contexts, methods=["GET"]),
                Route("/contexts/{id}", interpreter.remove_context, methods=["DELETE"]),
                Route("/contexts/{id}/restart", interpreter.restart_context, methods=["POST"]),
            ],
            default=no_route,
        )

    def sandbox_app(self, sandbox_id: str, port: int) -> ASGIApp:
        """The app that serves a sandbox's port: envd (49983) or the code interpreter
        (49999); any other port answers 502. Host-based routing calls this with the id and
        port of its host name."""
        inner: ASGIApp
        if port == ENVD_PORT:
            inner = self._envd
        elif port == INTERPRETER_PORT:
            inner = self.interpreter
        else:
            inner = _closed_port(port)

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"e2b-sandbox-id"]
            headers.append((b"e2b-sandbox-id", sandbox_id.encode("latin-1")))
            await inner({**scope, "headers": headers}, receive, send)

        return app

    async def _envd(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        route = path[len(root) :] if root and path.startswith(root) else path
        if route.startswith("/process.Process/"):
            await self.process(scope, receive, send)
        elif route.startswith("/filesystem.Filesystem/"):
            await self.filesystem(scope, receive, send)
        else:
            await self.envd_http(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # a websocket: E2B's API has none
            await send({"type": "websocket.close", "code": 1008, "reason": "E2B's API is HTTP"})
            return
        sandbox_id = port = None
        for name, value in scope.get("headers", ()):
            if name == b"e2b-sandbox-id":
                sandbox_id = value.decode("latin-1")
            elif name == b"e2b-sandbox-port":
                port = value.decode("latin-1")
        if sandbox_id is None:
            await self.control.router(scope, receive, send)
            return
        try:
            number = int(port) if port is not None else ENVD_PORT
        except ValueError:
            await error_json(400, f"E2b-Sandbox-Port {port!r} is not a port")(scope, receive, send)
            return
        await self.sandbox_app(sandbox_id, number)(scope, receive, send)


def _closed_port(port: int) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        message = f"The sandbox is running but port {port} is not open (only envd and the code "
        message += "interpreter are served over E2B's protocol here)"
        await error_json(502, message)(scope, receive, send)

    return app
