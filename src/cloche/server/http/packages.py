"""`POST /v1/sessions/{id}/packages`: install packages into a session, as `%pip install` does.

The install is queued behind the session's cells; the answer lists what was installed
(packages the session's runtime already has are not). A refusal is a 422 whose message
says why (policy, unknown package, no wheel, over --package-max-mib).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from cloche.packages.requirements import MAX_REQUIREMENT_CHARS, MAX_REQUIREMENTS
from cloche.server.http.auth import owner_of
from cloche.server.http.sessions import ERRORS
from cloche.sessions.manager import SessionManager

router = APIRouter(prefix="/v1/sessions", tags=["sessions"], responses=ERRORS)


class PackagesIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    packages: list[str] = Field(
        min_length=1,
        max_length=MAX_REQUIREMENTS,
        description='pip requirements by name and version, e.g. ["humanize==4.*"]',
        examples=[["humanize==4.*", "tabulate"]],
    )


class InstalledPackage(BaseModel):
    name: str
    version: str


class PackagesOut(BaseModel):
    installed: list[InstalledPackage]


@router.post(
    "/{session_id}/packages",
    response_model=PackagesOut,
    summary="Install packages (wheels fetched by the server) into the session",
)
async def install_packages(
    session_id: str,
    body: PackagesIn,
    request: Request,
    owner: str | None = Depends(owner_of),
) -> dict[str, Any]:
    manager: SessionManager = request.app.state.manager
    specs = [spec[: MAX_REQUIREMENT_CHARS + 1] for spec in body.packages]
    return {"installed": await manager.install_packages(session_id, specs, owner)}
