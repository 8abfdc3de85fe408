"""`/v1/cluster`: the nodes of a cluster-mode server, draining one and returning it to
service. An admin's only (a user's token is answered 403)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel

from cloche.errors import NodeNotFound
from cloche.server.http.auth import caller_of, require_admin
from cloche.server.http.models import ErrorBody
from cloche.server.http.sessions import ERRORS
from cloche.server.tenants import Caller
from cloche.sessions.manager import SessionManager

router = APIRouter(
    prefix="/v1/cluster", tags=["cluster"], responses={**ERRORS, 403: {"model": ErrorBody}}
)


class NodeOut(BaseModel):
    id: str
    address: str  # HOST:PORT of its agent's data path
    state: Literal["alive", "draining", "dead"]
    sessions: int  # live sessions
    paused: int  # paused on its disk
    pool: dict[str, int]  # ready sandboxes by profile
    memory_available_bytes: int
    pid: int  # the process that hosts the node agent, on its machine


class ClusterOut(BaseModel):
    ray_address: str
    nodes: list[NodeOut]


class DrainOut(BaseModel):
    node: str
    moved: int  # sessions now on other nodes, same id and state
    failed: list[str]  # sessions that stayed (paused) on the node
    why: dict[str, str] = {}  # each failed session's reason
    snapshots: int  # snapshots copied to other nodes
    snapshots_left: int = 0  # snapshots that stayed on it (no room, or the grace ran out)


class UndrainOut(BaseModel):
    node: str
    state: Literal["alive"]


def _manager(request: Request) -> SessionManager:
    manager: SessionManager = request.app.state.manager
    return manager


@router.get("", response_model=ClusterOut, summary="The cluster's nodes (cluster mode only)")
async def cluster(
    request: Request,
    caller: Caller = Depends(caller_of),  # noqa: B008
) -> dict[str, Any]:
    require_admin(caller, "view the cluster")
    view = _manager(request).cluster_view()
    if view is None:
        raise NodeNotFound("this server is not a cluster (start it with --cluster)")
    return view


@router.post(
    "/nodes/{node_id}/drain",
    response_model=DrainOut,
    summary="Move a node's sessions and snapshots to other nodes; it takes no new ones",
)
async def drain(
    node_id: str,
    request: Request,
    grace_s: float | None = Query(
        None,
        gt=0,
        le=3600,
        description="Move sessions for this long at most (default --node-grace); what is "
        "left is reported failed, with why",
    ),
    caller: Caller = Depends(caller_of),  # noqa: B008
) -> dict[str, Any]:
    """`node_id` may be the node's address (a leaving pod's preStop knows its IP)."""
    require_admin(caller, "drain a node")
    return await _manager(request).drain(node_id, grace_s)


@router.post(
    "/nodes/{node_id}/resume",
    response_model=UndrainOut,
    summary="Return a draining node to service: new sessions may go to it again",
)
async def undrain(
    node_id: str,
    request: Request,
    caller: Caller = Depends(caller_of),  # noqa: B008
) -> dict[str, Any]:
    require_admin(caller, "return a node to service")
    return await _manager(request).undrain(node_id)
