"""The event bus: what the session layer and the cluster report, numbered, kept a while, handed on.

The server's observer (`Metrics`) forwards each `Observer.event` to `EventBus.publish`,
which only appends: it never awaits, so it never delays a cell. Each event gets the next
id and waits in a ring buffer of the last `--events-buffer` events, from which a
subscriber that comes back with the last id it saw (SSE's `Last-Event-ID`) resumes; if
that id is older than the buffer holds, it is first told which ids it may have missed (an
`events.gap` notice). Listeners (webhooks) are handed each event as it is published.

A subscriber waits on a queue of its own, bounded: one that falls more than
`SUBSCRIBER_QUEUE` events behind is dropped (after what it was sent, an `events.dropped`
notice says so) and may come back with its last id.

Ids go up by one per event, from the server's start time in microseconds since the epoch:
a later run's ids are above an earlier run's, so a client that comes back to a restarted
server with an id of the earlier run is told of the gap instead of skipping events.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from cloche.server.jsonbody import json_bytes

log = logging.getLogger("cloche.events")

# What the session layer and the cluster report (operations.md, "Events and webhooks").
EVENT_TYPES = frozenset(
    {
        "session.created",
        "session.paused",
        "session.resumed",
        "session.forked",
        "session.snapshotted",
        "session.closed",
        "cell.started",
        "cell.finished",
        "quota.exceeded",
        "port.url_created",
        "node.up",
        "node.draining",
        "node.dead",
        "volume.created",
        "volume.deleted",
    }
)
GAP = "events.gap"  # a resumed subscriber's id is older than the buffer holds
DROPPED = "events.dropped"  # a subscriber fell too far behind and is let go
SUBSCRIBER_QUEUE = 1024  # events a subscriber may fall behind before it is dropped


def owner_tag(owner_key: str | None) -> str | None:
    """A short tag of an owner (as the logs show it): never the token, nor its full hash."""
    return None if owner_key is None else owner_key[:8]


def _iso(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).isoformat(timespec="milliseconds")


@dataclass(slots=True, eq=False)
class Event:
    """One thing that happened, as subscribers and webhooks receive it (`public()`)."""

    id: int
    type: str
    time: float  # unix time, s
    session_id: str | None
    owner_key: str | None  # the owner's token hashed (`sessions.session.owner_key`); never sent
    data: dict[str, Any]
    # The webhook receivers (`Receiver.id`) this server delivers it to; None: every one (see
    # `Observer.event`).
    webhooks: frozenset[str] | None = None
    _json: bytes | None = field(default=None, init=False, repr=False)

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "time": _iso(self.time),
            "session_id": self.session_id,
            "owner": owner_tag(self.owner_key),
            "data": self.data,
        }

    def json(self) -> bytes:
        """`public()` as JSON bytes, made once (by the first subscriber or webhook that
        needs it, not by `publish`)."""
        if self._json is None:
            self._json = json_bytes(self.public())
        return self._json


def notice(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """A message of the stream itself (`events.gap`, `events.dropped`): event-shaped, no id."""
    return {
        "id": None,
        "type": kind,
        "time": _iso(time.time()),
        "session_id": None,
        "owner": None,
        "data": data,
    }


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose events a subscriber may see: its owner's, or (an admin, or a server without
    tokens) everyone's."""

    owner_key: str | None = None
    everything: bool = False

    def allows(self, event: Event) -> bool:
        return self.everything or (self.owner_key is not None and event.owner_key == self.owner_key)


@dataclass(frozen=True, slots=True)
class Filter:
    """What a subscriber asked for, within its scope."""

    scope: Scope
    types: frozenset[str] | None = None  # None: every type
    session_id: str | None = None  # None: every session's (and events of none)

    def matches(self, event: Event) -> bool:
        return (
            (self.types is None or event.type in self.types)
            and (self.session_id is None or event.session_id == self.session_id)
            and self.scope.allows(event)
        )


class SubscriptionEnded(Exception):
    """The subscription ended: the bus closed, or the subscriber fell too far behind."""

    def __init__(self, reason: str, overflowed: bool) -> None:
        super().__init__(reason)
        self.overflowed = overflowed


class Subscription:
    """One subscriber's view of the bus: what it missed (`gap`), what the buffer held after
    its last id, then each matching event as it is published."""

    def __init__(
        self,
        bus: EventBus,
        wanted: Filter,
        bound: int,
        replay: Iterable[Event] = (),
        gap: dict[str, Any] | None = None,
    ) -> None:
        self.filter = wanted
        self.gap = gap  # data of an `events.gap` notice, or None
        self.last_id: int | None = None  # of the last event taken
        self._bus = bus
        self._bound = bound
        self._replay = deque(e for e in replay if wanted.matches(e))
        self._pending: deque[Event] = deque()
        self._ready = asyncio.Event()
        self._ended: SubscriptionEnded | None = None

    def offer(self, event: Event) -> bool:
        """Queue the event if it matches; False once this subscriber is over its bound."""
        if not self.filter.matches(event):
            return True
        if len(self._pending) >= self._bound:
            self._end(
                f"this stream fell more than {self._bound} events behind and was dropped; "
                "reconnect with Last-Event-ID to resume from the server's buffer",
                overflowed=True,
            )
            return False
        self._pending.append(event)
        self._ready.set()
        return True

    async def next(self, timeout_s: float) -> Event | None:
        """The next event, or None if none came within timeout_s.

        Raises:
            SubscriptionEnded: it ended, and every event queued before was taken.
        """
        while True:
            if self._replay:
                event = self._replay.popleft()
            elif self._pending:
                event = self._pending.popleft()
            elif self._ended is not None:
                raise self._ended
            else:
                self._ready.clear()
                try:
                    async with asyncio.timeout(timeout_s):
                        await self._ready.wait()
                except TimeoutError:
                    return None
                continue
            self.last_id = event.id
            return event

    def close(self) -> None:
        """Leave the bus (idempotent)."""
        self._bus.unsubscribe(self)

    def _end(self, reason: str, overflowed: bool) -> None:
        if self._ended is None:
            self._ended = SubscriptionEnded(reason, overflowed)
            self._ready.set()


class EventBus:
    """Numbers events, keeps the last `buffer` of them, and hands each to its listeners and
    the subscribers that want it."""

    def __init__(
        self,
        buffer: int = 10_000,
        first_id: int | None = None,
        subscriber_bound: int = SUBSCRIBER_QUEUE,
    ) -> None:
        self.buffer_size = buffer
        self._buffer: deque[Event] = deque(maxlen=buffer)
        self._next_id = time.time_ns() // 1000 if first_id is None else first_id
        self._subscriber_bound = subscriber_bound
        self._subscribers: dict[Subscription, None] = {}  # in the order they came
        self._listeners: list[Callable[[Event], None]] = []
        self.closed = False

    @property
    def next_id(self) -> int:
        """The id the next event will get."""
        return self._next_id

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def listen(self, listener: Callable[[Event], None]) -> None:
        """Hand every event to listener as it is published (it must not block)."""
        self._listeners.append(listener)

    def publish(
        self,
        kind: str,
        session_id: str | None,
        owner_key: str | None,
        data: dict[str, Any],
        webhooks: frozenset[str] | None = None,
    ) -> Event:
        """Number the event, keep it, hand it on (to the webhook receivers named, if any are).
        Never awaits, never raises."""
        event = Event(self._next_id, kind, time.time(), session_id, owner_key, data, webhooks)
        self._next_id += 1
        self._buffer.append(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not reach the session layer
                log.exception("event listener failed on %s", kind)
        behind: list[Subscription] | None = None
        for subscription in self._subscribers:
            if not subscription.offer(event):
                behind = behind or []
                behind.append(subscription)
        for subscription in behind or ():
            self.unsubscribe(subscription)
        return event

    def subscribe(self, wanted: Filter, after: int | None = None) -> Subscription:
        """A subscription to what wanted matches: from now on, or, with after (the last id
        the subscriber saw), from the buffer's events after it first."""
        if after is None:
            subscription = Subscription(self, wanted, self._subscriber_bound)
        else:
            replay, gap = self._since(after)
            subscription = Subscription(self, wanted, self._subscriber_bound, replay, gap)
        if self.closed:
            subscription._end("the server is stopping", overflowed=False)
        else:
            self._subscribers[subscription] = None
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.pop(subscription, None)

    def close(self) -> None:
        """End every subscription (each is sent what it had queued first); the server stops."""
        self.closed = True
        for subscription in self._subscribers:
            subscription._end("the server is stopping", overflowed=False)
        self._subscribers.clear()

    def _since(self, after: int) -> tuple[list[Event], dict[str, Any] | None]:
        """The buffered events after id after, and an `events.gap` notice's data if some
        events after it may have been lost."""
        first_held = self._buffer[0].id if self._buffer else self._next_id
        if first_held <= after < self._next_id:
            return list(islice(self._buffer, after + 1 - first_held, None)), None
        if after == first_held - 1:
            return list(self._buffer), None
        held = len(self._buffer)
        lost_from: int | None
        lost_to: int | None
        if after >= self._next_id:
            message = (
                f"event id {after} was not given by this server (an earlier run's clock?); "
                f"what happened since is unknown: here are the {held} events it holds"
            )
            lost_from = lost_to = None
        else:
            message = (
                f"events after id {after} up to id {first_held - 1} may have been missed: "
                f"the server holds the last {self.buffer_size} (--events-buffer), "
                f"from id {first_held}"
            )
            lost_from, lost_to = after + 1, first_held - 1
        gap = {
            "last_event_id": after,
            "lost_from": lost_from,
            "lost_to": lost_to,
            "message": message,
        }
        return list(self._buffer), gap
