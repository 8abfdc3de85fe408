"""Session events from a node agent to the front ends' buses.

A node's session layer reports events (`session.*`, `cell.*`) to its agent's observer; the
agent keeps them, numbered, in its `Outbox` (the last --events-buffer of them). Each front
end takes them over the data path with a long poll (`events_since`: what came after the
last number it took, or, if nothing has, the next to come) and publishes them on its own
bus with the node's id added (`data.node`): in order, each once, and none lost while the
link is up unless the outbox had to drop them first.

Adding to the outbox never waits, so no cell waits for a front end. If no front end takes
them, the oldest go first, counted. A front end starts at what no front end has taken when
it connects (the agent's greeting says where): a replica that comes after another's death
gets what happened meanwhile, one that joins beside a live one does not get its past.

Every front end tells every event on its own stream, but each webhook receiver must get it
once: a front end's poll names its receivers (`Receiver.id`), and the outbox gives each
event to the first poll that names a receiver, for that receiver (`claimed`). The front end
delivers an event only to the receivers it was given it for. One that dies between taking
events and delivering them loses those deliveries (as its webhook queues are lost anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any

from cloche.cluster.link import AgentLink, LinkDown
from cloche.errors import ClocheError
from cloche.sessions.observer import EventSink, Observer

log = logging.getLogger("cloche.cluster")

BATCH = 512  # events in one answer to a front end
WAIT_S = 20.0  # an agent with nothing new answers a front end's poll empty after this


class Outbox:
    """A node agent's last `capacity` events, numbered from 1, for the front ends to take."""

    def __init__(self, capacity: int, on_drop: Callable[[int], None] | None = None) -> None:
        """on_drop: told how many events were dropped before any front end took them."""
        self._kept: deque[tuple[int, list[Any]]] = deque(maxlen=max(1, capacity))
        self._on_drop = on_drop
        self.seq = 0  # the number of the last event added
        self.taken = 0  # the number of the last event a front end has taken
        self.dropped = 0  # events pushed out before any front end took them
        # The last event number given out for each webhook receiver (its `Receiver.id`).
        self.claimed: dict[str, int] = {}
        self._news = asyncio.Event()  # set (and replaced) at the next event, if polled
        self._polled = 0  # polls waiting for the next event

    def add(
        self, kind: str, session_id: str | None, owner_key: str | None, data: dict[str, Any]
    ) -> None:
        """Keep an event (never waits); the oldest goes if the outbox is full."""
        self.seq += 1
        kept = self._kept
        if len(kept) == kept.maxlen and kept[0][0] > self.taken:
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop(1)
        kept.append((self.seq, [kind, session_id, owner_key, data]))
        if self._polled:
            news, self._news = self._news, asyncio.Event()
            news.set()  # every poll waiting for this one

    async def since(
        self, seq: int, limit: int = BATCH, wait_s: float = 0.0, claim: Sequence[str] = ()
    ) -> dict[str, Any]:
        """The events after number seq (at most limit, oldest first), waiting up to wait_s
        for one if there is none yet: `{"seq": the last number given (or seq), "events":
        [[number, kind, session_id, owner_key, data], ...]}`. With claim (webhook receivers'
        ids), also `"claimed": {id: the last number given out for it before}`: the events
        after it are this caller's to deliver there, and nobody else's."""
        if self.seq <= seq and wait_s > 0:
            self._polled += 1
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._news.wait(), wait_s)
            finally:
                self._polled -= 1
        kept = self._kept
        first = kept[0][0] if kept else self.seq + 1
        start = max(0, seq + 1 - first)
        events = [[number, *event] for number, event in islice(kept, start, start + limit)]
        last = events[-1][0] if events else seq
        self.taken = max(self.taken, last)
        answer = {"seq": last, "events": events}
        if claim:
            before = {receiver: self.claimed.get(receiver, 0) for receiver in claim}
            for receiver, number in before.items():
                self.claimed[receiver] = max(number, last)
            answer["claimed"] = before
        return answer


class Told(Observer):
    """An observer that passes events on and ignores the rest (an agent without figures)."""

    def __init__(self, sink: EventSink) -> None:
        self._sink = sink

    def event(
        self,
        kind: str,
        session_id: str | None,
        owner_key: str | None,
        data: dict[str, Any],
        webhooks: frozenset[str] | None = None,
    ) -> None:
        self._sink(kind, session_id, owner_key, data, webhooks)


async def relay(
    link: AgentLink, after: int, sink: EventSink, webhooks: frozenset[str] = frozenset()
) -> None:
    """Take a node's events after number after and hand each to sink (in order, each once)
    until its link goes down, with the webhook receivers (of those given) it is this front
    end's to deliver to."""
    seen = after
    asked: dict[str, Any] = {"limit": BATCH, "wait_s": WAIT_S}
    if webhooks:
        asked["claim"] = sorted(webhooks)
    while True:
        try:
            reply = await link.call("events_since", {**asked, "seq": seen})
        except LinkDown:
            return
        except ClocheError as exc:  # an agent that can't tell its events: none come
            log.error("node %s does not tell its sessions' events: %s", link.node_id, exc)
            return
        claimed: dict[str, int] = reply.get("claimed", {})
        for number, kind, session_id, owner_key, data in reply["events"]:
            if number <= seen:
                continue
            if number > seen + 1:
                log.warning(
                    "node %s dropped %d events before this front end took them "
                    "(its --events-buffer was full)",
                    link.node_id,
                    number - seen - 1,
                )
            seen = number
            mine = frozenset(r for r in webhooks if number > claimed.get(r, 0))
            try:
                sink(kind, session_id, owner_key, data, mine)
            except Exception:  # one event's trouble must not stop the others
                log.exception("an event of node %s was not told", link.node_id)
