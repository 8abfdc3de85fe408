"""cloche's MCP tools: run_python, run_command, sessions, their history and files, written
once over
`surface.py` (what they answer is shaped in `content.py`).

Both transports use them: `cloche mcp` (stdio, through the client SDK to a server's HTTP
API) and /mcp on the server's own HTTP port (straight to the server's session manager,
`direct.py`). A `Scope` tells them which client and which MCP connection a call belongs
to; each connection gets a session of its own, made on first use, unless a call names one.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, Field

from cloche import __version__
from cloche.client.tool import CODE_DESCRIPTION, RUN_PYTHON_DESCRIPTION, TOOL_NAME
from cloche.errors import ClocheError, SessionNotFound
from cloche.server.mcp.content import (
    as_tool_errors,
    command_result,
    execution_result,
    file_content,
    history_result,
)
from cloche.server.mcp.surface import Scope, ToolClient, ToolSession
from cloche.server.mcp.volume_tools import add_volume_tools

log = logging.getLogger("cloche.mcp")

INSTRUCTIONS = (
    "cloche runs Python in persistent sandboxed sessions. Call run_python with code; state "
    "persists between calls in this connection's own session. run_command runs a shell "
    "command in the same session (its files, its machine). Pass session_id to use a "
    "session made with create_session instead. Use upload_file / download_file to move "
    "files in and out of a session's working directory, and session_history to see the "
    "cells a session ran. Volumes (create_volume) keep files between sessions: mount them "
    "with create_session(volumes=[...])."
)
RUN_COMMAND_DESCRIPTION = (
    "Run a shell command in a sandboxed session (a gVisor sandbox with no network), beside "
    "run_python's cells: the same files and machine. `cmd` is a command line for the "
    "session's shell (bash -lc, or sh -c); with `args`, `cmd` is the program, run directly. "
    "It runs as the session's user in its home (/home/user) unless told otherwise. Returns "
    "its stdout, stderr, exit code and status (exited, signaled, timeout, killed)."
)
SESSION_ID_DESCRIPTION = (
    "A session made with create_session; leave it out to use this connection's own session"
)
VOLUMES = (
    "Volumes of yours it mounts (see create_volume): each a name, mounted at /mnt/NAME, or "
    "{name, path, read_only}"
)


class VolumeMount(BaseModel):
    name: str = Field(max_length=64)
    path: str | None = Field(default=None, description="Absolute; default /mnt/NAME")
    read_only: bool = False


METADATA_DESCRIPTION = (
    "Labels of your choosing (string keys and values, at most 32 pairs), to find the "
    "session by with list_sessions"
)


class ConnectionSessions:
    """The session each MCP connection gets unless a call names one, made on first use."""

    def __init__(self) -> None:
        self._sessions: dict[str, ToolSession] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # one per connection: its first calls race

    async def get(self, client: ToolClient, key: str) -> tuple[ToolSession, str | None]:
        """The connection's session, and a note when it had to be replaced."""
        async with self._locks.setdefault(key, asyncio.Lock()):
            note = None
            session = self._sessions.get(key)
            if session is not None:
                try:
                    await session.refresh()
                    return session, None
                except SessionNotFound:
                    note = (
                        f"This connection's previous session {session.id} had ended (idle "
                        "timeout, or its sandbox was lost); a new one was made, so earlier "
                        "variables and files are gone."
                    )
            session = await client.create_session()
            self._sessions[key] = session
            log.info("MCP connection %s got session %s", key, session.id)
            return session, note

    def holds(self, key: str | None, session_id: str) -> bool:
        return key is not None and key in self._sessions and self._sessions[key].id == session_id

    def forget(self, session_id: str) -> None:
        for key, session in list(self._sessions.items()):
            if session.id == session_id:
                del self._sessions[key]

    async def close(self, key: str) -> None:
        """The connection ended: close its session."""
        self._locks.pop(key, None)
        session = self._sessions.pop(key, None)
        if session is not None:
            log.info("MCP connection %s ended: closing session %s", key, session.id)
            with contextlib.suppress(ClocheError):
                await session.close()

    async def close_all(self) -> None:
        for key in list(self._sessions):
            await self.close(key)


@contextlib.asynccontextmanager
async def _session_for(
    scope: Scope, sessions: ConnectionSessions, ctx: Context, session_id: str | None
) -> AsyncIterator[tuple[ToolSession, str | None]]:
    """The session a call names, else its connection's; a one-off one without a connection."""
    client = scope.client(ctx)
    if session_id:
        yield await client.session(session_id), None
        return
    key = scope.connection(ctx)
    if key is not None:
        yield await sessions.get(client, key)
        return
    session = await client.create_session()
    try:
        yield (
            session,
            (
                "This ran in a one-off session, closed afterwards: this MCP connection is "
                "stateless. To keep state between calls, call create_session and pass its "
                "session_id."
            ),
        )
    finally:
        with contextlib.suppress(ClocheError):
            await session.close()


@contextlib.contextmanager
def _logging_left_alone() -> Iterator[None]:
    """MCPServer() calls logging.basicConfig, which would give an unconfigured process a
    root handler (and level) of the SDK's choosing: the host's logging is its own."""
    root = logging.getLogger()
    placeholder = logging.NullHandler()
    root.addHandler(placeholder)
    try:
        yield
    finally:
        root.removeHandler(placeholder)


def build_server(scope: Scope, sessions: ConnectionSessions) -> MCPServer:
    """An MCPServer with cloche's tools, reaching sessions through `scope`."""
    with _logging_left_alone():
        server: MCPServer = MCPServer("cloche", instructions=INSTRUCTIONS, version=__version__)

    @server.tool(
        name=TOOL_NAME,
        description=RUN_PYTHON_DESCRIPTION,
        annotations=ToolAnnotations(title="Run Python", open_world_hint=False),
    )
    async def run_python(
        code: Annotated[str, Field(description=CODE_DESCRIPTION)],
        ctx: Context,
        session_id: Annotated[str | None, Field(description=SESSION_ID_DESCRIPTION)] = None,
        timeout: Annotated[  # noqa: ASYNC109 (the server's limit for the cell)
            float | None, Field(description="Time limit of this cell, s", gt=0)
        ] = None,
    ) -> CallToolResult:
        with as_tool_errors():
            async with _session_for(scope, sessions, ctx, session_id) as (session, note):
                execution = await session.run(code, timeout=timeout)
        return execution_result(execution, note)

    @server.tool(
        name="run_command",
        description=RUN_COMMAND_DESCRIPTION,
        annotations=ToolAnnotations(title="Run a command", open_world_hint=False),
    )
    async def run_command(
        cmd: Annotated[str, Field(description="A command line, or with args the program")],
        ctx: Context,
        args: Annotated[
            list[str] | None, Field(description="The program's arguments (no shell then)")
        ] = None,
        session_id: Annotated[str | None, Field(description=SESSION_ID_DESCRIPTION)] = None,
        timeout: Annotated[  # noqa: ASYNC109 (the server's limit for the command)
            float | None,
            Field(description="Seconds before it is killed (default 60; 0: none)", ge=0),
        ] = None,
        cwd: Annotated[str | None, Field(description="Where it runs (default: the home)")] = None,
        user: Annotated[
            str | None,
            Field(description="Whom it runs as: the session's user, or root (inside only)"),
        ] = None,
    ) -> CallToolResult:
        with as_tool_errors():
            async with _session_for(scope, sessions, ctx, session_id) as (session, note):
                result = await session.commands.run(
                    cmd, args=args, cwd=cwd, user=user, timeout=timeout
                )
        return command_result(result, session.id, note)

    @server.tool(description="Make a new session; its state lasts until close_session.")
    async def create_session(
        ctx: Context,
        profile: Annotated[
            str,
            Field(
                description="lean: nothing preloaded; data: numpy, pandas, matplotlib, "
                "scipy and sympy preloaded, so importing them is instant; or a profile "
                "the server defines (its --profiles file)",
                max_length=32,
            ),
        ] = "lean",
        snapshot: Annotated[
            str | None,
            Field(description="Start from this snapshot (see snapshot_session) instead"),
        ] = None,
        egress: Annotated[
            str | None,
            Field(
                description="Network access: the name of one of the server's egress "
                "policies (the hosts it allows, through a proxy on the server); none: no "
                "network, unless the server has a default policy",
                max_length=200,
            ),
        ] = None,
        metadata: Annotated[dict[str, str] | None, Field(description=METADATA_DESCRIPTION)] = None,
        template: Annotated[
            str | None,
            Field(
                description="The system it runs: python (the default), or a template the "
                "server built from an image (its own programs and packages)",
                max_length=32,
            ),
        ] = None,
        volumes: Annotated[list[str | VolumeMount] | None, Field(description=VOLUMES)] = None,
    ) -> CallToolResult:
        with as_tool_errors():
            session = await scope.client(ctx).create_session(
                profile,
                snapshot=snapshot,
                egress=egress,
                metadata=metadata,
                template=template,
                volumes=[v if isinstance(v, str) else v.model_dump() for v in volumes or ()],
            )
        profile, made_of = session.info.profile, session.info.template  # a snapshot's own
        return CallToolResult(
            content=[
                TextContent(
                    type="text",
                    text=f"Created session {session.id} ({profile}, template {made_of}). Pass "
                    f"session_id={session.id} to run_python, run_command, upload_file and "
                    "download_file; close it with close_session when done.",
                )
            ],
            structured_content={
                "session_id": session.id,
                "profile": profile,
                "template": made_of,
                "metadata": session.info.metadata,
                "volumes": session.info.volumes,
            },
        )

    @server.tool(description="Close a session and discard its state.")
    async def close_session(session_id: str, ctx: Context) -> str:
        with as_tool_errors():
            await scope.client(ctx).close_session(session_id)
        sessions.forget(session_id)
        return f"Closed session {session_id}."

    @server.tool(
        description="The sessions you can use, with their state, profile and metadata; "
        "only those matching the filters given.",
        annotations=ToolAnnotations(read_only_hint=True),
    )
    async def list_sessions(
        ctx: Context,
        state: Annotated[
            str | None, Field(description="Only those in this state: idle, busy, paused")
        ] = None,
        profile: Annotated[str | None, Field(description="Only those of this profile")] = None,
        metadata: Annotated[
            dict[str, str] | None,
            Field(description="Only those whose metadata has every one of these pairs"),
        ] = None,
    ) -> CallToolResult:
        with as_tool_errors():
            listed = await scope.client(ctx).list_sessions(
                state=state, profile=profile, metadata=metadata
            )
        key = scope.connection(ctx)
        rows = [
            {
                "session_id": info.id,
                "profile": info.profile,
                "state": info.state,
                "execution_count": info.execution_count,
                "expires_at": info.expires_at.isoformat(),
                "metadata": info.metadata,
                "this_connection": sessions.holds(key, info.id),
            }
            for info in listed
        ]
        lines = []
        for info, row in zip(listed, rows, strict=True):
            mine = "  (this connection's)" if row["this_connection"] else ""
            labels = "".join(f" {k}={v}" for k, v in info.metadata.items())
            lines.append(
                f"{row['session_id']}  {row['profile']:<5} {row['state']:<8} "
                f"cells={row['execution_count']}{labels}{mine}"
            )
        return CallToolResult(
            content=[TextContent(type="text", text="\n".join(lines) or "No sessions.")],
            structured_content={"sessions": rows},
        )

    @server.tool(
        description="Save a session as it is now (variables, imports, files); it keeps "
        "running. create_session(snapshot=...) starts a new session from the snapshot."
    )
    async def snapshot_session(
        session_id: str,
        ctx: Context,
        name: Annotated[str, Field(description="A name of your choosing")] = "",
    ) -> CallToolResult:
        with as_tool_errors():
            session = await scope.client(ctx).session(session_id)
            snapshot = await session.snapshot(name)
        return CallToolResult(
            content=[
                TextContent(
                    type="text",
                    text=f"Saved session {session_id} as snapshot {snapshot.id} "
                    f"({snapshot.size_bytes} bytes). Pass snapshot={snapshot.id} to "
                    "create_session to start a copy of it.",
                )
            ],
            structured_content={"snapshot_id": snapshot.id, "session_id": session_id},
        )

    @server.tool(
        description="Copy a session as it is now into count new, independent sessions (to "
        "try several continuations); the original keeps running."
    )
    async def fork_session(
        session_id: str,
        ctx: Context,
        count: Annotated[int, Field(description="Copies to make", ge=1)] = 1,
    ) -> CallToolResult:
        with as_tool_errors():
            session = await scope.client(ctx).session(session_id)
            copies = await session.fork(count)
        ids = [copy.id for copy in copies]
        return CallToolResult(
            content=[
                TextContent(
                    type="text",
                    text=f"Forked session {session_id} into {', '.join(ids)}; each runs on "
                    "its own from the state the original had.",
                )
            ],
            structured_content={"session_ids": ids, "session_id": session_id},
        )

    @server.tool(
        description="The cells a session ran (from any client), with each one's code, why it "
        "ended and its output (cut). Without `after`: its last `limit` cells.",
        annotations=ToolAnnotations(read_only_hint=True),
    )
    async def session_history(
        ctx: Context,
        session_id: Annotated[str | None, Field(description=SESSION_ID_DESCRIPTION)] = None,
        after: Annotated[
            int | None, Field(description="Only the cells numbered above this", ge=0)
        ] = None,
        limit: Annotated[int, Field(description="At most this many cells", ge=1, le=100)] = 10,
    ) -> CallToolResult:
        with as_tool_errors():
            async with _session_for(scope, sessions, ctx, session_id) as (session, _):
                if after is None:
                    last = int((session.info.last_cell or {}).get("number", 0))
                    after = max(0, last - limit)
                cells = await session.history(after, limit)
        return history_result(session.id, list(cells))

    @server.tool(
        description="The TCP ports servers listen on in a session (a dev server, a "
        "dashboard or a notebook started by its code or commands).",
        annotations=ToolAnnotations(read_only_hint=True),
    )
    async def list_ports(
        ctx: Context,
        session_id: Annotated[str | None, Field(description=SESSION_ID_DESCRIPTION)] = None,
    ) -> CallToolResult:
        with as_tool_errors():
            async with _session_for(scope, sessions, ctx, session_id) as (session, _):
                ports = await session.ports.list()
        listed = ", ".join(map(str, ports)) or "none"
        return CallToolResult(
            content=[TextContent(type="text", text=f"Ports listened on: {listed}")],
            structured_content={"session_id": session.id, "ports": ports},
        )

    @server.tool(
        description="A URL that opens a port of a session (a server started in it) in a "
        "browser, for anyone who holds it and without a token, until it expires.",
    )
    async def preview_port(
        port: Annotated[int, Field(description="The port the server listens on", ge=1, le=65535)],
        ctx: Context,
        session_id: Annotated[str | None, Field(description=SESSION_ID_DESCRIPTION)] = None,
        ttl_s: Annotated[
            int, Field(description="Seconds the URL works for", ge=1, le=86400)
        ] = 3600,
    ) -> CallToolResult:
        with as_tool_errors():
            async with _session_for(scope, sessions, ctx, session_id) as (session, _):
                preview = await session.ports.url(port, ttl_s=ttl_s)
        expires_at = preview.expires_at.isoformat()
        text = f"{preview.url}\n(works until {expires_at})"
        return CallToolResult(
            content=[TextContent(type="text", text=text)],
            structured_content={"url": preview.url, "expires_at": expires_at},
        )

    @server.tool(description="Write a file into a session's working directory.")
    async def upload_file(
        path: Annotated[str, Field(description="Path under the working directory")],
        content: Annotated[str, Field(description="The file's content (text, or base64)")],
        ctx: Context,
        session_id: Annotated[str | None, Field(description=SESSION_ID_DESCRIPTION)] = None,
        is_base64: Annotated[bool, Field(description="content is base64 (binary files)")] = False,
    ) -> str:
        try:
            data = base64.b64decode(content, validate=True) if is_base64 else content.encode()
        except (binascii.Error, ValueError) as exc:
            raise ToolError(f"content is not valid base64: {exc}") from exc
        with as_tool_errors():
            async with _session_for(scope, sessions, ctx, session_id) as (session, note):
                await session.upload(path, data)
        done = f"Wrote {len(data)} bytes to {path} in session {session.id}."
        return f"{done}\nnote: {note}" if note else done

    @server.tool(
        description="Read a file from a session's working directory: text as text, images "
        "as images, anything else as base64.",
        annotations=ToolAnnotations(read_only_hint=True),
    )
    async def download_file(
        path: Annotated[str, Field(description="Path under the working directory")],
        ctx: Context,
        session_id: Annotated[str | None, Field(description=SESSION_ID_DESCRIPTION)] = None,
    ) -> CallToolResult:
        with as_tool_errors():
            async with _session_for(scope, sessions, ctx, session_id) as (session, _):
                data = await session.download(path)
        return CallToolResult(content=file_content(path, data))

    add_volume_tools(server, scope)
    return server
