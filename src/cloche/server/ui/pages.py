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


def metadata_of(info: SessionInfo) -> dict[str, str]:
    metadata: dict[str, str] = getattr(info, "metadata", None) or {}
    return metadata


def usage_of(info: SessionInfo) -> dict[str, float | None]:
    """CPU seconds and memory bytes of a session, where the manager tells them."""
    return {
        "cpu_s": getattr(info, "cpu_s", None),
        "memory_bytes": getattr(info, "memory_bytes", None),
    }


def wanted_metadata(request: Request) -> dict[str, str]:
    """Metadata filters: `metadata.KEY=VALUE` parameters, and the form's `meta=KEY=VALUE`."""
    wanted: dict[str, str] = {}
    for key, value in request.query_params.multi_items():
        if key.startswith("metadata.") and len(key) > len("metadata."):
            wanted[key.removeprefix("metadata.")] = value
        elif key == "meta":
            for pair in value.split(","):
                name, equals, wanted_value = pair.strip().partition("=")
                if name and equals:
                    wanted[name.strip()] = wanted_value.strip()
    return wanted


async def profile_names(manager: SessionManager) -> list[str]:
    describe = getattr(manager, "profiles", None)
    rows: list[dict[str, Any]] = await asyncio.to_thread(describe) if describe else []
    return [str(row["name"]) for row in rows if row.get("state") == "ready"] or ["lean"]


@router.get("/", include_in_schema=False)
async def sessions(request: Request, who: Visitor = Depends(visitor)) -> Response:  # noqa: B008
    manager = manager_of(request)
    infos = await manager.sessions(who.owner)
    state = request.query_params.get("state", "")
    profile = request.query_params.get("profile", "")
    metadata = wanted_metadata(request)
    shown = [
        info
        for info in infos
        if (not state or info.state.value == state)
        and (not profile or info.profile == profile)
        and all(metadata_of(info).get(k) == v for k, v in metadata.items())
    ]
    shown.sort(key=lambda info: info.created_at, reverse=True)
    return page(
        request,
        "sessions.html",
        who,
        title="Sessions",
        rows=[(info, metadata_of(info), usage_of(info)) for info in shown],
        total=len(infos),
        states=[s.value for s in SessionState if s is not SessionState.CLOSED],
        profiles=sorted({info.profile for info in infos} | set(await profile_names(manager))),
        state=state,
        profile=profile,
        meta=", ".join(f"{k}={v}" for k, v in metadata.items()),
        copies=set(request.query_params.getlist("copy")),
        show_usage=any(v is not None for info in shown for v in usage_of(info).values()),
        show_end=any(getattr(info, "end_reason", None) for info in shown),
    )


def history_version(info: SessionInfo, cells: Cells) -> str:
    """Changes whenever the session's history may have: the page polls with it."""
    seen = (
        f"{info.state.value}/{info.execution_count}/{info.queued_cells}/{info.last_active}/"
        f"{cells.version(info.id)}"
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
        metadata=metadata_of(info),
        usage=usage_of(info),
        end_reason=getattr(info, "end_reason", None),
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
