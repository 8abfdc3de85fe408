"""The event bus for the inspector's pages, as Server-Sent Events a browser's EventSource can
open with the sign-in cookie (it can't send the API's bearer token to /v1/events).

The visitor sees what GET /v1/events would show its token (`scope_of`). A first connection
replays what the bus still holds (the page keeps the last rows); a reconnection resumes
after its Last-Event-ID. Each frame is a plain `message` with the event's public JSON.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import StreamingResponse

from cloche.server.events import EventBus, Filter, Subscription, SubscriptionEnded, notice
from cloche.server.http.events import HEARTBEAT_S, scope_of
from cloche.server.jsonbody import json_bytes
from cloche.server.ui.signin import Visitor, visitor

router = APIRouter()


@router.get("/events/stream", include_in_schema=False)
async def stream(
    request: Request,
    session: str | None = None,
    last_event_id: int | None = Header(None, alias="Last-Event-ID", ge=0),
    who: Visitor = Depends(visitor),  # noqa: B008
) -> StreamingResponse:
    bus: EventBus = request.app.state.api.state.events
    wanted = Filter(scope_of(request, who.owner), None, session)
    if last_event_id is None:  # the tail: everything the bus holds, no gap told
        subscription = bus.subscribe(wanted, max(0, bus.next_id - 1 - bus.buffer_size))
        subscription.gap = None
    else:
        subscription = bus.subscribe(wanted, last_event_id)
    heartbeat_s: float = getattr(request.app.state.api.state, "events_heartbeat_s", HEARTBEAT_S)
    return StreamingResponse(
        _frames(subscription, heartbeat_s),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _frames(subscription: Subscription, heartbeat_s: float) -> AsyncIterator[bytes]:
    try:
        yield b": subscribed\n\n"
        if subscription.gap is not None:
            yield b"data: " + json_bytes(notice("events.gap", subscription.gap)) + b"\n\n"
        while True:
            try:
                event = await subscription.next(heartbeat_s)
            except SubscriptionEnded:
                return  # the browser reconnects with Last-Event-ID by itself
            if event is None:
                yield b": heartbeat\n\n"
            else:
                yield b"id: %d\ndata: " % event.id + event.json() + b"\n\n"
    finally:
        subscription.close()
