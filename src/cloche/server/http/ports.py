"""A session's ports, as the API tells of them: the ports listened on, and preview URLs.

What reaches a port (the path and host routes, websockets) is `port_routes`'s, in front of
the API; these two are the API's own.
"""

from __future__ import annotations

import datetime
from typing import Any

from fastapi import APIRouter, Body, Depends, Path, Request
from pydantic import BaseModel, ConfigDict, Field

from cloche.server.http import previews
from cloche.server.http.auth import owner_of
from cloche.server.http.models import ErrorBody
from cloche.server.http.previews import PreviewDomain
from cloche.server.signing import Signer
from cloche.sessions.manager import SessionManager

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 410, 501, 502, 503)
}
router = APIRouter(prefix="/v1/sessions", tags=["ports"], responses=ERRORS)


class PortOut(BaseModel):
    port: int = Field(description="A TCP port something listens on in the session")


class PortsOut(BaseModel):
    ports: list[PortOut]


class PreviewIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttl_s: int = Field(
        default=3600,
        ge=previews.MIN_TTL_S,
        le=previews.MAX_TTL_S,
        description="Seconds the URL works for (1 to 86400)",
    )


class PreviewOut(BaseModel):
    url: str = Field(description="The port's URL, with its preview token")
    expires_at: str = Field(description="When the token stops working (ISO 8601, UTC)")


@router.get(
    "/{session_id}/ports",
    response_model=PortsOut,
    summary="The TCP ports something listens on in the session (its loopback, 0.0.0.0, ::)",
)
async def list_ports(
    session_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    manager: SessionManager = request.app.state.manager
    found = await manager.ports(session_id, owner)
    return {"ports": [{"port": port} for port in found]}


@router.post(
    "/{session_id}/ports/{port}/url",
    response_model=PreviewOut,
    summary="A signed URL that opens one port of the session, without the API's token, "
    "until it expires",
)
async def preview_url(
    session_id: str,
    request: Request,
    port: int = Path(ge=1, le=65535),
    asked: PreviewIn | None = Body(default=None),  # noqa: B008
    owner: str | None = Depends(owner_of),
) -> dict[str, Any]:
    ttl_s = (asked or PreviewIn()).ttl_s
    url, when = await make_preview(
        request.app, session_id, port, owner, ttl_s, str(request.base_url)
    )
    return {"url": url, "expires_at": when}


async def make_preview(
    app: Any, session_id: str, port: int, owner: str | None, ttl_s: int, base_url: str
) -> tuple[str, str]:
    """A preview URL of a port of the owner's session, and when it expires (ISO 8601, UTC);
    told as a `port.url_created` event. base_url: where the API is reached (its path route
    is the URL's without --preview-domain).

    Raises:
        SessionNotFound: unknown, or another owner's.
    """
    manager: SessionManager = app.state.manager
    info = await manager.info(session_id, owner)  # the owner's (else 404)
    signer: Signer = app.state.signer
    token, expires_at = previews.mint(signer, session_id, port, info.owner_key, ttl_s)
    domain: PreviewDomain | None = app.state.hosts.domain
    if domain is not None:
        url = domain.url(port, session_id)
    else:
        url = f"{base_url.rstrip('/')}/v1/sessions/{session_id}/ports/{port}/"
    when = datetime.datetime.fromtimestamp(expires_at, datetime.UTC).isoformat()
    data = {"port": port, "ttl_s": ttl_s, "expires_at": when}
    app.state.metrics.event("port.url_created", session_id, info.owner_key, data)
    return previews.with_token(url, token), when
