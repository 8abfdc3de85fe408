"""A session's cell history and its metadata: `GET /v1/sessions/{id}/cells`,
`GET /v1/sessions/{id}/cells/{number}`, `PATCH /v1/sessions/{id}` (operations.md)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from cloche.server.http.auth import owner_of
from cloche.server.http.models import CellList, CellOut, ErrorBody, MetadataPatch, SessionOut
from cloche.server.http.sessions import describe
from cloche.sessions.manager import SessionManager

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "Malformed request"},
    401: {"model": ErrorBody, "description": "Missing or invalid token"},
    404: {"model": ErrorBody, "description": "Unknown session, or no such cell kept"},
    410: {"model": ErrorBody, "description": "The session was lost"},
}
MAX_CELLS_PER_PAGE = 1000

router = APIRouter(prefix="/v1/sessions", tags=["history"], responses=ERRORS)


@router.get(
    "/{session_id}/cells",
    response_model=CellList,
    summary="The session's cells, oldest first (its last --history-cells)",
)
async def cells(
    session_id: str,
    request: Request,
    after: int = Query(0, ge=0, description="Only cells numbered above this"),
    limit: int = Query(100, ge=1, le=MAX_CELLS_PER_PAGE, description="At most this many"),
    owner: str | None = Depends(owner_of),
) -> dict[str, Any]:
    manager: SessionManager = request.app.state.manager
    found = await manager.history(session_id, owner, after=after, limit=limit)
    return {"cells": [entry.to_json() for entry in found]}


@router.get("/{session_id}/cells/{number}", response_model=CellOut, summary="One cell")
async def cell(
    session_id: str, number: int, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    manager: SessionManager = request.app.state.manager
    return (await manager.cell(session_id, number, owner)).to_json()


@router.patch(
    "/{session_id}",
    response_model=SessionOut,
    summary="Merge metadata into the session's (a null value deletes its key)",
)
async def patch_session(
    session_id: str, body: MetadataPatch, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    manager: SessionManager = request.app.state.manager
    return describe(request, await manager.set_metadata(session_id, body.metadata, owner))
