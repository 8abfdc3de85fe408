"""Volumes (`/v1/volumes`): files that outlive sessions, named per tenant and held to their
size; their files reached without a session. A session mounts them at its creation
(`POST /v1/sessions {"volumes": [...]}`). The manager does the work: nothing here touches
a volume's directory.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from cloche.server.http.auth import owner_of
from cloche.server.http.models import FileList
from cloche.server.http.sessions import ERRORS, _manager
from cloche.sessions.volumes import VolumeInfo

# Uploads are streamed into the volume: bodies here may be as large as a volume may be.
UPLOAD_PATH = re.compile(r"^/v1/volumes/[^/]+/files/.+$")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"

router = APIRouter(
    prefix="/v1/volumes",
    tags=["volumes"],
    responses=ERRORS | {501: ERRORS[400], 507: ERRORS[400]},
)


class VolumeCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(
        max_length=64,
        pattern=NAME_PATTERN,
        description="1-64 letters, digits, _, . and -, starting with a letter or digit; "
        "yours alone (another tenant may use the same name)",
    )
    size_mib: int = Field(
        ge=1,
        description="Its size, MiB: a write past it fails with ENOSPC (at most the server's "
        "--volume-max-mib)",
    )


class VolumeOut(BaseModel):
    name: str
    size_mib: int
    created_at: str = Field(description="ISO 8601, UTC")
    used_bytes: int = Field(description="What its files take now")
    capacity_bytes: int = Field(description="What its files may take (its size less metadata)")
    sessions: list[str] = Field(description="Live or paused sessions that mount it")


class VolumeList(BaseModel):
    volumes: list[VolumeOut]


def _out(info: VolumeInfo) -> dict[str, Any]:
    out = info.to_json()
    out["created_at"] = datetime.datetime.fromtimestamp(info.created_at, datetime.UTC).isoformat()
    return out


@router.post("", status_code=201, response_model=VolumeOut, summary="Create a volume")
async def create_volume(
    body: VolumeCreate, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    return _out(await _manager(request).create_volume(body.name, body.size_mib, owner))


@router.get("", response_model=VolumeList, summary="The caller's volumes")
async def list_volumes(request: Request, owner: str | None = Depends(owner_of)) -> dict[str, Any]:
    return {"volumes": [_out(info) for info in await _manager(request).volumes(owner)]}


@router.get("/{name}", response_model=VolumeOut, summary="A volume: size, use, who mounts it")
async def get_volume(
    name: str, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    return _out(await _manager(request).volume(name, owner))


@router.delete(
    "/{name}",
    status_code=204,
    response_class=Response,
    summary="Delete a volume and its files; 409 while a live or paused session mounts it",
)
async def delete_volume(
    name: str, request: Request, owner: str | None = Depends(owner_of)
) -> Response:
    await _manager(request).delete_volume(name, owner)
    return Response(status_code=204)


@router.get("/{name}/files", response_model=FileList, summary="List a volume's files")
async def list_files(
    name: str, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    listing = await _manager(request).volume_files(name, owner)
    return {
        "files": [
            {"path": f.path, "size_bytes": f.size_bytes, "modified": f.modified}
            for f in listing.files
        ],
        "truncated": listing.truncated,
    }


@router.get(
    "/{name}/files/{path:path}",
    summary="Download a file of a volume (a symlink is never followed)",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def download(
    name: str, path: str, request: Request, owner: str | None = Depends(owner_of)
) -> Response:
    size, pieces = await _manager(request).read_volume_file(name, path, owner)
    return StreamingResponse(
        pieces, media_type="application/octet-stream", headers={"content-length": str(size)}
    )


@router.put(
    "/{name}/files/{path:path}",
    status_code=204,
    summary="Upload a file (raw body, streamed; its directories made); 507 past the size",
)
async def upload(
    name: str, path: str, request: Request, owner: str | None = Depends(owner_of)
) -> Response:
    manager = _manager(request)
    await manager.volume(name, owner)  # an unknown volume is told before the body is read
    await manager.write_volume_file(name, path, request.stream(), owner)
    return Response(status_code=204)


@router.delete(
    "/{name}/files/{path:path}",
    status_code=204,
    response_class=Response,
    summary="Delete a file, a symlink (not what it points at) or a directory of a volume",
)
async def delete_file(
    name: str, path: str, request: Request, owner: str | None = Depends(owner_of)
) -> Response:
    await _manager(request).delete_volume_file(name, path, owner)
    return Response(status_code=204)
