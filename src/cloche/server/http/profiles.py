"""`GET /v1/profiles`: the session profiles, built-in and from --profiles, with their state."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from cloche.server.http.auth import owner_of
from cloche.server.http.sessions import ERRORS

router = APIRouter(prefix="/v1/profiles", tags=["profiles"], responses=ERRORS)


class ProfilePackage(BaseModel):
    name: str
    version: str


class ProfileOut(BaseModel):
    name: str
    state: Literal["building", "ready", "failed"]
    error: str | None
    packages: list[ProfilePackage]
    built_in: bool


class ProfileList(BaseModel):
    profiles: list[ProfileOut]


@router.get("", response_model=ProfileList, summary="Session profiles and their state")
async def list_profiles(
    request: Request,
    owner: str | None = Depends(owner_of),  # noqa: B008  # a token, when the server wants one
) -> dict[str, Any]:
    describe = getattr(request.app.state.manager, "profiles", None)
    rows = await asyncio.to_thread(describe) if describe is not None else []
    return {"profiles": rows}
