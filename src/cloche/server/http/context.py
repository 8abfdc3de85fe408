"""`PUT /v1/sessions/{id}/context`: stream a large context into a session.

The body goes to a file in the session's working directory as it arrives (up to the size
of the working directory, --disk-mib, not --max-frame-bytes), and the session loads it,
silently, as the variable `context`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request

from cloche.llm.context import CONTEXT_FILES, ContextKind, put_context
from cloche.server.http.auth import owner_of
from cloche.server.http.models import ContextOut
from cloche.server.http.sessions import ERRORS
from cloche.sessions.manager import SessionManager

PATH = re.compile(r"^/v1/sessions/[^/]+/context$")  # bodies here may be as large as a workdir
router = APIRouter(prefix="/v1/sessions", tags=["sessions"], responses=ERRORS)


@router.put(
    "/{session_id}/context",
    response_model=ContextOut,
    summary="Stream a context (raw body) into the session as the variable `context`",
)
async def put_session_context(
    session_id: str,
    request: Request,
    format: Literal["text", "json"] | None = Query(
        None, description="How to load it; by default json for Content-Type application/json"
    ),
    owner: str | None = Depends(owner_of),
) -> dict[str, Any]:
    manager: SessionManager = request.app.state.manager
    await manager.info(session_id, owner)  # 404 before reading the body
    kind: ContextKind = format or (
        "json" if request.headers.get("content-type", "").startswith("application/json") else "text"
    )
    size = await put_context(manager, session_id, owner, request.stream(), kind)
    return {"kind": kind, "file": CONTEXT_FILES[kind], "size_bytes": size}
