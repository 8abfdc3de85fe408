"""What the MCP tools need of cloche, for one caller: a few calls on sessions.

Two things have this surface. The client SDK's `AsyncClient` and `AsyncSession` are one
as they stand (`cloche mcp --url`: a client of a server's HTTP API); `direct.py` is the
other, over the server's own session manager (/mcp inside the server).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from mcp.server.mcpserver import Context

from cloche.client.execution import Cell, Execution
from cloche.client.info import FileInfo, SessionInfo, SnapshotInfo
from cloche.client.ports import PreviewURL
from cloche.client.process import CommandResult
from cloche.client.volumes import VolumeInfo


class ToolCommands(Protocol):
    """A session's commands, as a caller runs them."""

    async def run(
        self,
        cmd: str,
        *,
        args: Sequence[str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the server's limit for the command)
    ) -> CommandResult: ...


class ToolPorts(Protocol):
    """A session's ports, as a caller reaches them (the SDK's `AsyncPorts` is one)."""

    async def list(self) -> list[int]: ...

    async def url(self, port: int, *, ttl_s: int = 3600) -> PreviewURL: ...


class ToolSession(Protocol):
    """One session, as a caller reaches it."""

    @property
    def id(self) -> str: ...

    @property
    def info(self) -> SessionInfo:
        """As last told (made, fetched or refreshed)."""

    @property
    def ports(self) -> ToolPorts:
        """Its servers: the ports listened on, and preview URLs."""

    async def refresh(self) -> SessionInfo:
        """As it is now. Raises SessionNotFound when it ended."""

    @property
    def commands(self) -> ToolCommands: ...

    async def run(
        self,
        code: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the server's limit for the cell)
    ) -> Execution: ...

    async def upload(self, path: str, data: bytes) -> None: ...

    async def download(self, path: str) -> bytes: ...

    async def snapshot(self, name: str = "") -> SnapshotInfo: ...

    async def fork(self, count: int = 1) -> Sequence[ToolSession]: ...

    async def history(self, after: int = 0, limit: int | None = None) -> Sequence[Cell]:
        """Its cells numbered above after, oldest first, at most limit."""

    async def close(self) -> None:
        """Idempotent: an ended session is fine."""


class ToolClient(Protocol):
    """The sessions one caller (one token, or none) may use."""

    async def create_session(
        self,
        profile: str = "lean",
        *,
        snapshot: str | None = None,
        egress: str | None = None,
        metadata: Mapping[str, str] | None = None,
        template: str | None = None,
        volumes: Sequence[str | Mapping[str, Any]] = (),
    ) -> ToolSession: ...

    async def session(self, session_id: str) -> ToolSession:
        """Raises SessionNotFound: unknown, ended, or another token's."""

    async def list_sessions(
        self,
        *,
        state: str | None = None,
        profile: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Sequence[SessionInfo]:
        """Those in a state, of a profile, carrying every pair of metadata given."""

    async def close_session(self, session_id: str) -> None: ...

    # -- volumes (`volume_tools.py`) -------------------------------------------------------

    async def create_volume(self, name: str, size_mib: int) -> VolumeInfo: ...

    async def volumes(self) -> Sequence[VolumeInfo]: ...

    async def delete_volume(self, name: str) -> None: ...

    async def volume_files(self, name: str) -> Sequence[FileInfo]: ...

    async def upload_to_volume(self, name: str, path: str, data: bytes | str) -> None: ...

    async def download_from_volume(self, name: str, path: str) -> bytes: ...


class Scope(abc.ABC):
    """Which cloche client, and which MCP connection, a tool call belongs to."""

    @abc.abstractmethod
    def client(self, ctx: Context) -> ToolClient:
        """The client to reach sessions with, for this call's caller."""

    @abc.abstractmethod
    def connection(self, ctx: Context) -> str | None:
        """A key for the caller's MCP connection; None when the transport has none."""
