"""Sessions that outlive their sandbox: snapshots (`/v1/snapshots`), and a session's
snapshot, fork, pause and resume (`/v1/sessions/{id}/...`). The manager does the work."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from cloche.server.http.auth import owner_of
from cloche.server.http.models import (
    ForkRequest,
    SessionList,
    SessionOut,
    SnapshotCreate,
    SnapshotList,
    SnapshotOut,
)
from cloche.server.http.sessions import ERRORS, _iso, _manager, describe
from cloche.sessions.store import SnapshotRecord

router = APIRouter(prefix="/v1", tags=["snapshots"], responses=ERRORS | {507: ERRORS[400]})


def _snapshot_out(record: SnapshotRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "session_id": record.session_id,
        "name": record.name,
        "profile": record.profile,
        "created_at": _iso(record.created_at),
        "size_bytes": record.size_bytes,
        "execution_count": record.execution_count,
    }


@router.post(
    "/sessions/{session_id}/snapshot",
    status_code=201,
    response_model=SnapshotOut,
    summary="Save the session as it is now; it keeps running",
)
async def snapshot_session(
    session_id: str,
    request: Request,
    body: SnapshotCreate | None = None,
    owner: str | None = Depends(owner_of),
) -> dict[str, Any]:
    name = body.name if body is not None else ""
    return _snapshot_out(await _manager(request).snapshot(session_id, owner, name))


@router.post(
    "/sessions/{session_id}/fork",
    status_code=201,
    response_model=SessionList,
    summary="Copies of the session as it is now; it keeps running",
)
async def fork_session(
    session_id: str,
    request: Request,
    body: ForkRequest | None = None,
    owner: str | None = Depends(owner_of),
) -> dict[str, Any]:
    count = body.count if body is not None else 1
    copies = await _manager(request).fork(session_id, count, owner)
    return {"sessions": [describe(request, info) for info in copies]}


@router.post(
    "/sessions/{session_id}/pause",
    response_model=SessionOut,
    summary="Save the session to disk and free its memory; any request resumes it",
)
async def pause_session(
    session_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    return describe(request, await _manager(request).pause(session_id, owner))


@router.post("/sessions/{session_id}/resume", response_model=SessionOut, summary="Resume now")
async def resume_session(
    session_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    return describe(request, await _manager(request).resume(session_id, owner))


@router.get("/snapshots", response_model=SnapshotList, summary="The caller's snapshots")
async def list_snapshots(request: Request, owner: str | None = Depends(owner_of)) -> dict[str, Any]:
    return {"snapshots": [_snapshot_out(r) for r in await _manager(request).snapshots(owner)]}


@router.get("/snapshots/{snapshot_id}", response_model=SnapshotOut, summary="One snapshot")
async def get_snapshot(
    snapshot_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    return _snapshot_out(await _manager(request).get_snapshot(snapshot_id, owner))


@router.delete("/snapshots/{snapshot_id}", status_code=204, summary="Delete a snapshot")
async def delete_snapshot(
    snapshot_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> Response:
    await _manager(request).delete_snapshot(snapshot_id, owner)
    return Response(status_code=204)
