"""`GET /v1/events`: the event bus as Server-Sent Events, scoped to the caller's sessions.

Each event is a frame `id: <id>`, `event: <type>`, `data: <the event as JSON>` (so a
browser's EventSource can listen by type, and resumes by itself with `Last-Event-ID`).
Frames the stream makes itself have no id: `events.gap` when a resumed stream may have
missed events, `events.dropped` before a stream that fell too far behind is closed. A
comment line every `HEARTBEAT_S` keeps proxies from closing a quiet stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import Response, StreamingResponse

from cloche.server.events import (
    DROPPED,
    EVENT_TYPES,
    GAP,
    EventBus,
    Filter,
    Scope,
    Subscription,
    SubscriptionEnded,
    notice,
)
from cloche.server.http.auth import can_see_all, owner_of
from cloche.server.http.errors import error_response
from cloche.server.http.sessions import ERRORS
from cloche.server.jsonbody import json_bytes
from cloche.sessions.session import owner_key

HEARTBEAT_S = 15.0
router = APIRouter(prefix="/v1", tags=["events"], responses=ERRORS)


def scope_of(request: Request, owner: str | None) -> Scope:
    """Whose events the caller may see: without tokens, everyone's; with a token, the
    sessions of that token; an admin's (--admin-token, role = "admin"), everyone's."""
    if owner is None or can_see_all(request):
        return Scope(everything=True)
    return Scope(owner_key=owner_key(owner))


@router.get(
    "/events",
    summary="Events (sessions, cells, quotas, nodes) as Server-Sent Events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def events(
    request: Request,
    types: str | None = Query(
        None,
        description="Comma-separated event types to send (default: all): "
        + ", ".join(sorted(EVENT_TYPES)),
    ),
    session: str | None = Query(None, description="Only the events of this session"),
    last_event_id: int | None = Query(
        None,
        ge=0,
        description="Resume after this event id (for clients that can't send the "
        "Last-Event-ID header, which wins when both are given)",
    ),
    last_event_id_header: int | None = Header(
        None,
        alias="Last-Event-ID",
        ge=0,
        description="Resume after this event id, from the server's buffer (--events-buffer)",
    ),
    owner: str | None = Depends(owner_of),
) -> Response:
    wanted: frozenset[str] | None = None
    if types:
        names = frozenset(name.strip() for name in types.split(",") if name.strip())
        unknown = sorted(names - EVENT_TYPES)
        if unknown:
            return error_response(
                400,
                "invalid_request",
                f"unknown event type {', '.join(map(repr, unknown))} in types; known: "
                + ", ".join(sorted(EVENT_TYPES)),
            )
        wanted = names or None
    after = last_event_id_header if last_event_id_header is not None else last_event_id
    bus: EventBus = request.app.state.events
    subscription = bus.subscribe(Filter(scope_of(request, owner), wanted, session), after)
    heartbeat_s: float = getattr(request.app.state, "events_heartbeat_s", HEARTBEAT_S)
    return StreamingResponse(
        _frames(subscription, heartbeat_s),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _frame(kind: str, body: bytes, event_id: int | None = None) -> bytes:
    head = b"" if event_id is None else b"id: %d\n" % event_id
    return head + b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


def _notice(kind: str, data: dict[str, Any]) -> bytes:
    return _frame(kind, json_bytes(notice(kind, data)))


async def _frames(subscription: Subscription, heartbeat_s: float) -> AsyncIterator[bytes]:
    try:
        # A first line at once: the client knows it is subscribed (headers alone may wait).
        yield b": subscribed\n\n"
        if subscription.gap is not None:
            yield _notice(GAP, subscription.gap)
        while True:
            try:
                event = await subscription.next(heartbeat_s)
            except SubscriptionEnded as ended:
                if ended.overflowed:
                    yield _notice(
                        DROPPED, {"message": str(ended), "last_event_id": subscription.last_id}
                    )
                return
            if event is None:
                yield b": heartbeat\n\n"
            else:
                yield _frame(event.type, event.json(), event.id)
    finally:
        subscription.close()
