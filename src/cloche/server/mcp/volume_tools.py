"""cloche's MCP tools for volumes (files that outlive sessions): create, list and delete
them; list, write and read their files without a session. `create_session(volumes=...)`
mounts them into a session.

The tools reach volumes through the caller's client (`surface.ToolClient`): the client
SDK's `AsyncClient` over HTTP (`cloche mcp`), or `ManagerVolumes` over the server's own
manager (/mcp inside the server).
"""

from __future__ import annotations

import base64
import binascii
import datetime
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import Field

from cloche.client.info import FileInfo
from cloche.client.volumes import VolumeInfo
from cloche.server.mcp.content import as_tool_errors, file_content

if TYPE_CHECKING:
    from cloche.server.mcp.surface import Scope
    from cloche.sessions import volumes
    from cloche.sessions.manager import SessionManager

NAME = Annotated[str, Field(description="The volume's name", max_length=64)]
PATH = Annotated[str, Field(description="A path inside the volume, relative to its root")]


def _info(info: volumes.VolumeInfo) -> VolumeInfo:
    created = datetime.datetime.fromtimestamp(info.created_at, datetime.UTC)
    return VolumeInfo(
        info.name, info.size_mib, created, info.used_bytes, info.capacity_bytes, info.sessions
    )


class ManagerVolumes:
    """The volume verbs of the tools' surface over the server's own manager (a part of
    `direct.ManagerClient`, whose caller is `owner`)."""

    manager: SessionManager
    owner: str | None

    async def create_volume(self, name: str, size_mib: int) -> VolumeInfo:
        return _info(await self.manager.create_volume(name, size_mib, self.owner))

    async def volumes(self) -> list[VolumeInfo]:
        return [_info(info) for info in await self.manager.volumes(self.owner)]

    async def delete_volume(self, name: str) -> None:
        await self.manager.delete_volume(name, self.owner)

    async def volume_files(self, name: str) -> list[FileInfo]:
        listing = await self.manager.volume_files(name, self.owner)
        return [FileInfo(f.path, f.size_bytes, f.modified) for f in listing.files]

    async def upload_to_volume(self, name: str, path: str, data: bytes | str) -> None:
        async def one() -> AsyncIterator[bytes]:
            yield data.encode() if isinstance(data, str) else data

        await self.manager.write_volume_file(name, path, one(), self.owner)

    async def download_from_volume(self, name: str, path: str) -> bytes:
        _, pieces = await self.manager.read_volume_file(name, path, self.owner)
        return b"".join([piece async for piece in pieces])


def add_volume_tools(server: MCPServer, scope: Scope) -> None:
    """Register the volume tools on server, reaching volumes through scope."""

    @server.tool(
        description="Make a volume: a directory of yours that outlives sessions, never "
        "larger than size_mib (a write past it fails with ENOSPC). Mount it with "
        "create_session(volumes=[name]); several sessions may mount it at once."
    )
    async def create_volume(
        name: Annotated[
            str,
            Field(description="1-64 letters, digits, _, . and -", max_length=64),
        ],
        size_mib: Annotated[int, Field(description="Its size, MiB", ge=1)],
        ctx: Context,
    ) -> CallToolResult:
        with as_tool_errors():
            volume = await scope.client(ctx).create_volume(name, size_mib)
        return CallToolResult(
            content=[
                TextContent(
                    type="text",
                    text=f"Created volume {volume.name} ({volume.size_mib} MiB). Mount it "
                    f"with create_session(volumes=['{volume.name}']) at /mnt/{volume.name}.",
                )
            ],
            structured_content={"name": volume.name, "size_mib": volume.size_mib},
        )

    @server.tool(
        description="Your volumes, with their size, what their files take, and the sessions "
        "that mount them.",
        annotations=ToolAnnotations(read_only_hint=True),
    )
    async def list_volumes(ctx: Context) -> CallToolResult:
        with as_tool_errors():
            listed = await scope.client(ctx).volumes()
        rows = [
            {
                "name": v.name,
                "size_mib": v.size_mib,
                "used_bytes": v.used_bytes,
                "sessions": list(v.sessions),
            }
            for v in listed
        ]
        lines = [
            f"{v.name}  {v.size_mib} MiB, {v.used_bytes} bytes used, mounted by "
            f"{len(v.sessions)} sessions"
            for v in listed
        ]
        return CallToolResult(
            content=[TextContent(type="text", text="\n".join(lines) or "No volumes.")],
            structured_content={"volumes": rows},
        )

    @server.tool(
        description="Delete a volume and all its files (refused while a session mounts it)."
    )
    async def delete_volume(name: NAME, ctx: Context) -> str:
        with as_tool_errors():
            await scope.client(ctx).delete_volume(name)
        return f"Deleted volume {name}."

    @server.tool(
        description="The files of a volume, with their sizes.",
        annotations=ToolAnnotations(read_only_hint=True),
    )
    async def list_volume_files(name: NAME, ctx: Context) -> CallToolResult:
        with as_tool_errors():
            files = await scope.client(ctx).volume_files(name)
        return CallToolResult(
            content=[
                TextContent(
                    type="text",
                    text="\n".join(f"{f.size_bytes:>10}  {f.path}" for f in files)
                    or f"Volume {name} has no files.",
                )
            ],
            structured_content={
                "files": [{"path": f.path, "size_bytes": f.size_bytes} for f in files]
            },
        )

    @server.tool(description="Write a file into a volume (its directories made).")
    async def write_volume_file(
        name: NAME,
        path: PATH,
        content: Annotated[str, Field(description="The file's content (text, or base64)")],
        ctx: Context,
        is_base64: Annotated[bool, Field(description="content is base64 (binary files)")] = False,
    ) -> str:
        try:
            data = base64.b64decode(content, validate=True) if is_base64 else content.encode()
        except (binascii.Error, ValueError) as exc:
            raise ToolError(f"content is not valid base64: {exc}") from exc
        with as_tool_errors():
            await scope.client(ctx).upload_to_volume(name, path, data)
        return f"Wrote {len(data)} bytes to {path} in volume {name}."

    @server.tool(
        description="Read a file of a volume: text as text, images as images, anything else "
        "as base64.",
        annotations=ToolAnnotations(read_only_hint=True),
    )
    async def read_volume_file(name: NAME, path: PATH, ctx: Context) -> CallToolResult:
        with as_tool_errors():
            data = await scope.client(ctx).download_from_volume(name, path)
        return CallToolResult(content=file_content(path, data))
