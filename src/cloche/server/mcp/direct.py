"""The tools' surface over the server's own session manager: /mcp inside the server calls
the manager as the HTTP API would, with no HTTP on the way.

Each call is the caller's: `owner` is its token (None on a server without tokens), as the
API's own routes pass it. What comes back has the shapes the API answers with (a cell's
result, a session's or snapshot's description), so the tools read the same values either
way, and the per-session cell time limits set at creation over HTTP hold here too.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from cloche.client.execution import Cell, Execution, cell_from_json, execution_from_json
from cloche.client.info import SessionInfo, SnapshotInfo
from cloche.client.ports import PreviewURL
from cloche.client.process import CommandResult
from cloche.client.volumes import mounts
from cloche.config import Limits
from cloche.errors import NotSupported, SessionNotFound
from cloche.server.http.results import execute_body
from cloche.server.http.sessions import _session_out
from cloche.server.http.snapshots import _snapshot_out
from cloche.server.mcp.volume_tools import ManagerVolumes
from cloche.sessions import session as sessions
from cloche.sessions.commands import CommandSpec
from cloche.sessions.manager import SessionManager

# (session id, port, owner, ttl_s) -> (URL, expires at): the API's own preview maker
PreviewMaker = Callable[[str, int, str | None, int], Awaitable[tuple[str, str]]]


class ManagerClient(ManagerVolumes):
    """One caller's sessions and volumes, reached through the manager (a `ToolClient`)."""

    def __init__(
        self,
        manager: SessionManager,
        owner: str | None,
        limits: Limits,
        session_timeouts: dict[str, float],
        previews: PreviewMaker | None = None,
    ) -> None:
        self.manager = manager
        self.owner = owner
        self._limits = limits
        self._timeouts = session_timeouts  # the HTTP API's: cell time limits by session id
        self.previews = previews

    def describe(self, info: sessions.SessionInfo) -> SessionInfo:
        timeout_s = self._timeouts.get(info.id, self._limits.cell_timeout_s)
        return SessionInfo.from_json(_session_out(info, self._limits, timeout_s))

    def cell_timeout_s(self, session_id: str) -> float | None:
        """The session's own cell time limit, when it was made with one."""
        return self._timeouts.get(session_id)

    async def create_session(
        self,
        profile: str = "lean",
        *,
        snapshot: str | None = None,
        egress: str | None = None,
        metadata: Mapping[str, str] | None = None,
        template: str | None = None,
        volumes: Sequence[str | Mapping[str, Any]] = (),
    ) -> ManagerSession:
        more: dict[str, Any] = {"volumes": mounts(volumes)} if volumes else {}
        info = await self.manager.create(
            self.owner,
            profile=profile,
            snapshot=snapshot,
            egress=egress,
            metadata=metadata,
            template=template,
            **more,
        )
        return ManagerSession(self, self.describe(info))

    async def session(self, session_id: str) -> ManagerSession:
        return ManagerSession(self, self.describe(await self.manager.info(session_id, self.owner)))

    async def list_sessions(
        self,
        *,
        state: str | None = None,
        profile: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> list[SessionInfo]:
        found = await self.manager.sessions(
            self.owner, state=state, profile=profile, metadata=metadata
        )
        return [self.describe(info) for info in found]

    async def close_session(self, session_id: str) -> None:
        await self.manager.close(session_id, self.owner, reason="deleted")
        self._timeouts.pop(session_id, None)


class ManagerSession:
    """One session of a `ManagerClient`'s caller (a `ToolSession`)."""

    def __init__(self, client: ManagerClient, info: SessionInfo) -> None:
        self.client = client
        self.info = info
        self.closed = False

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def commands(self) -> ManagerCommands:
        return ManagerCommands(self)

    @property
    def ports(self) -> ManagerPorts:
        return ManagerPorts(self.client, self.id)

    async def refresh(self) -> SessionInfo:
        client = self.client
        self.info = client.describe(await client.manager.info(self.id, client.owner))
        return self.info

    async def run(
        self,
        code: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the server's limit for the cell)
    ) -> Execution:
        client = self.client
        result = await client.manager.execute(
            self.id,
            code,
            owner=client.owner,
            timeout_s=timeout or client.cell_timeout_s(self.id),
            front_end="mcp",
        )
        return execution_from_json(execute_body(result), session_id=self.id)

    async def upload(self, path: str, data: bytes) -> None:
        await self.client.manager.write_files(self.id, [(path, data)], self.client.owner)

    async def download(self, path: str) -> bytes:
        return await self.client.manager.read_file(self.id, path, self.client.owner)

    async def snapshot(self, name: str = "") -> SnapshotInfo:
        record = await self.client.manager.snapshot(self.id, self.client.owner, name)
        return SnapshotInfo.from_json(_snapshot_out(record))

    async def fork(self, count: int = 1) -> list[ManagerSession]:
        client = self.client
        copies = await client.manager.fork(self.id, count, client.owner)
        return [ManagerSession(client, client.describe(info)) for info in copies]

    async def history(self, after: int = 0, limit: int | None = None) -> list[Cell]:
        client = self.client
        kept = await client.manager.history(self.id, client.owner, after=after, limit=limit)
        return [cell_from_json(entry.to_json(), self.id) for entry in kept]

    async def close(self) -> None:
        if self.closed:
            return
        with contextlib.suppress(SessionNotFound):
            await self.client.close_session(self.id)
        self.closed = True


class ManagerCommands:
    """The commands of a `ManagerSession` (a `ToolCommands`)."""

    def __init__(self, session: ManagerSession) -> None:
        self.session = session

    async def run(
        self,
        cmd: str,
        *,
        args: Sequence[str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the server's limit for the command)
    ) -> CommandResult:
        spec = CommandSpec(
            cmd=cmd,
            args=tuple(args) if args is not None else None,
            cwd=cwd,
            user=user,
            timeout_s=timeout,
        )
        client = self.session.client
        result = await client.manager.run_command(
            self.session.id, spec, owner=client.owner, front_end="mcp"
        )
        return CommandResult.from_json(result.to_json())


class ManagerPorts:
    """A session's ports through the manager (a `ToolPorts`)."""

    def __init__(self, client: ManagerClient, session_id: str) -> None:
        self.client = client
        self.session_id = session_id

    async def list(self) -> list[int]:
        return await self.client.manager.ports(self.session_id, self.client.owner)

    async def url(self, port: int, *, ttl_s: int = 3600) -> PreviewURL:
        if self.client.previews is None:
            raise NotSupported("this MCP endpoint makes no preview URLs")
        url, when = await self.client.previews(self.session_id, port, self.client.owner, ttl_s)
        return PreviewURL(url, datetime.datetime.fromisoformat(when))
