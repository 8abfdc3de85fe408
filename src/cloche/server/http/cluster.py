"""`/v1/cluster`: the nodes of a cluster-mode server, draining one and returning it to
service."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from cloche.errors import NodeNotFound
from cloche.server.http.auth import owner_of
from cloche.server.http.sessions import ERRORS
from cloche.sessions.manager import SessionManager

router = APIRouter(prefix="/v1/cluster", tags=["cluster"], responses=ERRORS)


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


class UndrainOut(BaseModel):
    node: str
    state: Literal["alive"]


def _manager(request: Request) -> SessionManager:
    manager: SessionManager = request.app.state.manager
    return manager


@router.get("", response_model=ClusterOut, summary="The cluster's nodes (cluster mode only)")
async def cluster(
    request: Request,
    owner: str | None = Depends(owner_of),  # noqa: B008  # a token, when the server wants one
) -> dict[str, Any]:
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
    owner: str | None = Depends(owner_of),  # noqa: B008
) -> dict[str, Any]:
    return await _manager(request).drain(node_id)


@router.post(
    "/nodes/{node_id}/resume",
    response_model=UndrainOut,
    summary="Return a draining node to service: new sessions may go to it again",
)
async def undrain(
    node_id: str,
    request: Request,
    owner: str | None = Depends(owner_of),  # noqa: B008
) -> dict[str, Any]:
    return await _manager(request).undrain(node_id)
