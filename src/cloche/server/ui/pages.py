"""The inspector's pages (GET): sessions, one session and its history, snapshots, profiles
and pools, events, the cluster. Each asks the session manager as the signed-in caller, so a
user sees only their own."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from cloche.errors import SessionLost, SessionNotFound
from cloche.server.tenants import Tenants
from cloche.server.ui.cells import Cells
from cloche.server.ui.render import page
from cloche.server.ui.signin import Visitor, may_see_cluster, visitor
from cloche.sessions.manager import SessionManager
from cloche.sessions.session import SessionInfo, SessionState

router = APIRouter()
STOP_POLLING = 286  # htmx stops a poll answered with this
EVENTS_KEPT = 200  # rows of the event tail a page keeps


def manager_of(request: Request) -> SessionManager:
    manager: SessionManager = request.app.state.manager
    return manager


def cells_of(request: Request) -> Cells:
    cells: Cells = request.app.state.cells
    return cells


def pairs(text: str) -> dict[str, str]:
    """`key=value, key=value` as a form's field writes metadata."""
    found: dict[str, str] = {}
    for pair in text.split(","):
        key, equals, value = pair.strip().partition("=")
        if key.strip() and equals:
            found[key.strip()] = value.strip()
    return found


def wanted_metadata(request: Request) -> dict[str, str]:
    """Metadata filters: `metadata.KEY=VALUE` parameters (as the API's), and the form's
    `meta=KEY=VALUE, ...`."""
    wanted: dict[str, str] = {}
    for key, value in request.query_params.multi_items():
        if key.startswith("metadata.") and len(key) > len("metadata."):
            wanted[key.removeprefix("metadata.")] = value
        elif key == "meta":
            wanted.update(pairs(value))
    return wanted


async def profile_names(manager: SessionManager) -> list[str]:
    """The profiles a session can be made of now, `lean` (the default) first."""
    describe = getattr(manager, "profiles", None)
    rows: list[dict[str, Any]] = await asyncio.to_thread(describe) if describe else []
    ready = {str(row["name"]) for row in rows if row.get("state") == "ready"}
    return ["lean", *sorted(ready - {"lean"})]


def tenant_of(request: Request, info: SessionInfo) -> str | None:
    """The name of the tenant a session belongs to (an admin's view of everyone's)."""
    tenants: Tenants = request.app.state.api.state.tenants
    tenant = tenants.by_owner_key(info.owner_key)
    return tenant.name if tenant is not None else None


@router.get("/", include_in_schema=False)
async def sessions(request: Request, who: Visitor = Depends(visitor)) -> Response:  # noqa: B008
    manager = manager_of(request)
    state = request.query_params.get("state", "")
    profile = request.query_params.get("profile", "")
    metadata = wanted_metadata(request)
    everyone = request.query_params.get("all") == "1" and who.caller.sees_all
    infos = await manager.sessions(
        who.owner,
        every=everyone,
        state=state or None,
        profile=profile or None,
        metadata=metadata,
    )
    infos.sort(key=lambda info: info.created_at, reverse=True)
    mine = who.caller.owner_key
    return page(
        request,
        "sessions.html",
        who,
        title="Sessions",
        rows=[(info, info.owner_key == mine, tenant_of(request, info)) for info in infos],
        states=[
            s.value for s in SessionState if s not in (SessionState.CLOSING, SessionState.CLOSED)
        ],
        profiles=await profile_names(manager),
        state=state,
        profile=profile,
        meta=", ".join(f"{k}={v}" for k, v in metadata.items()),
        everyone=everyone,
        may_see_everyone=who.caller.sees_all and who.caller.tenant is not None,
        copies=set(request.query_params.getlist("copy")),
    )


def history_version(info: SessionInfo, cells: Cells) -> str:
    """Changes whenever the session's history may have: the page polls with it."""
    last = (info.last_cell or {}).get("number")
    seen = (
        f"{info.state.value}/{info.execution_count}/{info.queued_cells}/{info.last_active}/"
        f"{last}/{cells.version(info.id)}"
    )
    return hashlib.sha256(seen.encode()).hexdigest()[:16]


async def history_context(request: Request, info: SessionInfo, who: Visitor) -> dict[str, Any]:
    cells = cells_of(request)
    return {
        "info": info,
        "cells": await cells.history(manager_of(request), info.id, who.owner),
        "version": history_version(info, cells),
    }


@router.get("/sessions/{session_id}", include_in_schema=False)
async def session(
    session_id: str,
    request: Request,
    who: Visitor = Depends(visitor),  # noqa: B008
) -> Response:
    manager = manager_of(request)
    info = await manager.info(session_id, who.owner)
    return page(
        request,
        "session.html",
        who,
        title=f"Session {info.id}",
        **await history_context(request, info, who),
    )


@router.get("/sessions/{session_id}/history", include_in_schema=False)
async def history(
    session_id: str,
    request: Request,
    v: str = "",
    who: Visitor = Depends(visitor),  # noqa: B008
) -> Response:
    """The history, for the page's poll: 204 while nothing changed; 286 (stop) once the
    session is gone."""
    try:
        info = await manager_of(request).info(session_id, who.owner)
    except (SessionNotFound, SessionLost) as exc:
        return page(request, "_ended.html", who, STOP_POLLING, message=str(exc))
    if v == history_version(info, cells_of(request)):
        return Response(status_code=204)
    return page(request, "_history.html", who, **await history_context(request, info, who))


@router.get("/snapshots", include_in_schema=False)
async def snapshots(request: Request, who: Visitor = Depends(visitor)) -> Response:  # noqa: B008
    records = await manager_of(request).snapshots(who.owner)
    return page(
        request, "snapshots.html", who, title="Snapshots", snapshots=list(reversed(records))
    )


@router.get("/profiles", include_in_schema=False)
async def profiles(request: Request, who: Visitor = Depends(visitor)) -> Response:  # noqa: B008
    manager = manager_of(request)
    describe = getattr(manager, "profiles", None)
    rows: list[dict[str, Any]] = await asyncio.to_thread(describe) if describe else []
    pools = [
        {
            "profile": name,
            "ready": pool.ready_count,
            "target": pool.target,
            "hits": pool.hits,
            "misses": pool.misses,
        }
        for name, pool in getattr(manager, "pools", {}).items()
    ]
    return page(request, "profiles.html", who, title="Profiles and pools", rows=rows, pools=pools)


@router.get("/events", include_in_schema=False)
async def events(request: Request, who: Visitor = Depends(visitor)) -> Response:  # noqa: B008
    return page(request, "events.html", who, title="Events", kept=EVENTS_KEPT)


@router.get("/cluster", include_in_schema=False)
async def cluster(request: Request, who: Visitor = Depends(visitor)) -> Response:  # noqa: B008
    manager = manager_of(request)
    view = manager.cluster_view() if may_see_cluster(manager, who) else None
    if view is None:
        return page(request, "error.html", who, 404, title="Not found", message=NO_CLUSTER)
    return page(request, "cluster.html", who, title="Cluster", view=view)


NO_CLUSTER = "this server is not a cluster (start it with --cluster)"
