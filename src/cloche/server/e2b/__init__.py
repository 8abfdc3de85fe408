"""The E2B front end: E2B's SDKs and every framework's E2B executor, unchanged, on cloche.

    E2B_API_URL=http://HOST:8080/e2b  E2B_SANDBOX_URL=http://HOST:8080/e2b  E2B_API_KEY=<token>

Everything is under `/e2b` on the HTTP port. A request with `E2b-Sandbox-Id` is a
sandbox's: `E2b-Sandbox-Port` 49983 is envd (`process.Process` and `filesystem.Filesystem`
over Connect with the JSON codec, served by the `connectrpc` runtime and the protobuf
modules the `e2b` wheel ships; `/files`, `/health`), 49999 the code interpreter
(`/execute`, `/contexts`). Anything else is the control plane (`control`). A sandbox is a
cloche session of the same manager: `/v1`, the inspector, history (front end `e2b`),
events and metrics see it. `FrontEnd.sandbox_app(id, port)` is the seam for host-based
routing (`{port}-{id}.{domain}`): the ASGI app that serves that port of that sandbox.

Kept out of cloche's OpenAPI schema: it is E2B's API, whose schema is E2B's own.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from cloche.config import Limits
from cloche.sessions.manager import SessionManager

if TYPE_CHECKING:
    from cloche.server.e2b.app import E2B

PREFIX = "/e2b"


class FrontEnd:
    """The front end, made at its first request: the `e2b` wheel it uses for its protocol
    types takes seconds to import on a loaded machine, which no server start should pay."""

    def __init__(self, manager: SessionManager, limits: Limits) -> None:
        self.manager = manager
        self.limits = limits
        self.app: E2B | None = None
        self._making = asyncio.Lock()

    async def ready(self) -> E2B:
        async with self._making:
            if self.app is None:
                module = await asyncio.to_thread(importlib.import_module, "cloche.server.e2b.app")
                self.app = module.E2B(self.manager, self.limits)
            return self.app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.app or await self.ready()
        await app(scope, receive, send)

    async def sandbox_app(self, sandbox_id: str, port: int) -> ASGIApp:
        """The app serving one port of one sandbox (49983 envd, 49999 the interpreter),
        for a host-based router; it checks the sandbox's tokens as the header route does."""
        return (await self.ready()).sandbox_app(sandbox_id, port)

    async def stop(self) -> None:
        if self.app is not None:
            await self.app.sandboxes.stop()


def mount(app: FastAPI, manager: SessionManager, limits: Limits) -> FrontEnd:
    """Serve E2B's API at /e2b on app."""
    front_end = FrontEnd(manager, limits)
    app.state.e2b = front_end
    app.mount(PREFIX, front_end)
    return front_end


__all__ = ["PREFIX", "FrontEnd", "mount"]
