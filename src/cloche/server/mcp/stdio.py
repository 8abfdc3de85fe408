"""`cloche mcp`: the MCP tools over stdio, as a client of a server's HTTP API.

The process serves one MCP client, so it is one connection: its session is made on first
use and closed when the client goes away (stdin closes, or SIGTERM).
"""

from __future__ import annotations

import asyncio
import logging
import signal

from mcp.server.mcpserver import Context

from cloche.client.aio import AsyncClient
from cloche.errors import ClocheError
from cloche.server.mcp.surface import Scope
from cloche.server.mcp.tools import ConnectionSessions, build_server

log = logging.getLogger("cloche.mcp")


class RemoteScope(Scope):
    """One client of a server's HTTP API; the process's stdio is the one connection."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    def client(self, ctx: Context) -> AsyncClient:
        return self._client

    def connection(self, ctx: Context) -> str | None:
        return "stdio"


async def serve_stdio(client: AsyncClient) -> None:
    """Serve MCP on stdin/stdout until the client leaves; then close its session."""
    sessions = ConnectionSessions()
    server = build_server(RemoteScope(client), sessions)
    try:
        await client.list_sessions()
    except ClocheError as exc:  # say so now; each tool call will say it again
        log.warning("%s", exc)
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is not None:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        await server.run_stdio_async()
    except asyncio.CancelledError:
        log.info("terminated")
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        await sessions.close_all()
