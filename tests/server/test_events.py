"""The event bus (unit tests), and `GET /v1/events` against a real gVisor server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cloche.server.events import (
    DROPPED,
    GAP,
    EventBus,
    Filter,
    Scope,
    SubscriptionEnded,
)
from cloche.server.http.events import _frames
from cloche.sessions.session import owner_key
from support import ServerThread, make_config, require_gvisor

EVERYONE = Filter(Scope(everything=True))
WAIT_S = 5.0  # for an event already published: generous on a busy machine


def publish_n(bus: EventBus, n: int, kind: str = "cell.finished", **extra: Any) -> list[int]:
    return [bus.publish(kind, f"s{i}", extra.get("owner"), {"i": i}).id for i in range(n)]


async def take(subscription: Any, n: int) -> list[Any]:
    taken = []
    for _ in range(n):
        event = await subscription.next(WAIT_S)
        assert event is not None, f"only {len(taken)} of {n} events came"
        taken.append(event)
    return taken


# -- the bus ---------------------------------------------------------------------------------


def test_ids_increase_by_one_per_event():
    bus = EventBus(first_id=100)
    assert publish_n(bus, 3) == [100, 101, 102]
    assert bus.next_id == 103


def test_ids_start_at_the_start_time_so_a_later_run_numbers_above_an_earlier():
    before_us = time.time_ns() // 1000
    bus = EventBus()
    assert before_us <= bus.next_id <= time.time_ns() // 1000


def test_an_event_says_what_happened_and_whose_by_a_tag_never_the_key():
    bus = EventBus(first_id=1)
    key = owner_key("a token")
    assert key is not None
    event = bus.publish("session.created", "s1", key, {"profile": "lean"})
    public = json.loads(event.json())
    assert public["id"] == 1
    assert public["type"] == "session.created"
    assert public["session_id"] == "s1"
    assert public["owner"] == key[:8]
    assert public["data"] == {"profile": "lean"}
    assert public["time"].endswith("+00:00")
    assert key not in event.json().decode()
    assert "a token" not in event.json().decode()


async def test_a_subscriber_gets_what_is_published_after_it_came():
    bus = EventBus(first_id=1)
    publish_n(bus, 2)  # before: not sent
    subscription = bus.subscribe(EVERYONE)
    ids = publish_n(bus, 3)
    assert [e.id for e in await take(subscription, 3)] == ids
    assert subscription.gap is None


async def test_resuming_after_an_id_gets_what_followed_then_what_comes():
    bus = EventBus(first_id=1)
    ids = publish_n(bus, 5)
    subscription = bus.subscribe(EVERYONE, after=ids[1])
    later = publish_n(bus, 2)
    assert [e.id for e in await take(subscription, 5)] == ids[2:] + later
    assert subscription.gap is None


async def test_resuming_at_the_newest_id_gets_only_new_events():
    bus = EventBus(first_id=1)
    ids = publish_n(bus, 3)
    subscription = bus.subscribe(EVERYONE, after=ids[-1])
    later = publish_n(bus, 1)
    assert [e.id for e in await take(subscription, 1)] == later
    assert subscription.gap is None


async def test_the_buffer_keeps_only_the_last_events_and_a_gap_says_which_were_lost():
    bus = EventBus(buffer=3, first_id=1)
    publish_n(bus, 10)  # ids 1..10; 8, 9, 10 are kept
    subscription = bus.subscribe(EVERYONE, after=4)
    assert subscription.gap is not None
    assert subscription.gap["last_event_id"] == 4
    assert (subscription.gap["lost_from"], subscription.gap["lost_to"]) == (5, 7)
    assert "--events-buffer" in subscription.gap["message"]
    assert [e.id for e in await take(subscription, 3)] == [8, 9, 10]


async def test_resuming_just_before_the_oldest_kept_is_no_gap():
    bus = EventBus(buffer=3, first_id=1)
    publish_n(bus, 10)
    subscription = bus.subscribe(EVERYONE, after=7)
    assert subscription.gap is None
    assert [e.id for e in await take(subscription, 3)] == [8, 9, 10]


async def test_an_id_this_server_never_gave_is_a_gap_and_the_buffer_is_sent():
    bus = EventBus(first_id=1)
    publish_n(bus, 2)
    subscription = bus.subscribe(EVERYONE, after=1_000_000)
    assert subscription.gap is not None
    assert subscription.gap["lost_from"] is None
    assert "not given by this server" in subscription.gap["message"]
    assert [e.id for e in await take(subscription, 2)] == [1, 2]


async def test_an_id_of_an_earlier_run_is_a_gap_on_a_fresh_bus():
    bus = EventBus(first_id=500)  # nothing published yet in this run
    subscription = bus.subscribe(EVERYONE, after=20)
    assert subscription.gap is not None
    assert (subscription.gap["lost_from"], subscription.gap["lost_to"]) == (21, 499)
    later = publish_n(bus, 1)
    assert [e.id for e in await take(subscription, 1)] == later


async def test_filters_by_type_and_by_session():
    bus = EventBus(first_id=1)
    by_type = bus.subscribe(Filter(Scope(everything=True), types=frozenset({"cell.started"})))
    by_session = bus.subscribe(Filter(Scope(everything=True), session_id="s2"))
    bus.publish("session.created", "s1", None, {})
    started = bus.publish("cell.started", "s1", None, {})
    in_s2 = bus.publish("session.created", "s2", None, {})
    assert await take(by_type, 1) == [started]
    assert await take(by_session, 1) == [in_s2]
    bus.close()
    for subscription in (by_type, by_session):
        with pytest.raises(SubscriptionEnded):
            await subscription.next(WAIT_S)


async def test_a_replay_is_filtered_too():
    bus = EventBus(first_id=1)
    bus.publish("session.created", "s1", None, {})
    wanted = bus.publish("cell.finished", "s1", None, {})
    subscription = bus.subscribe(
        Filter(Scope(everything=True), types=frozenset({"cell.finished"})), after=0
    )
    assert await take(subscription, 1) == [wanted]


async def test_an_owner_sees_only_its_own_events_and_everyone_all():
    bus = EventBus(first_id=1)
    alice, bob = owner_key("alice"), owner_key("bob")
    of_alice = bus.subscribe(Filter(Scope(owner_key=alice)))
    of_everyone = bus.subscribe(EVERYONE)
    bus.publish("session.created", "of-bob", bob, {})
    bus.publish("node.dead", None, None, {})  # nobody's: only a scope of everything sees it
    mine = bus.publish("session.created", "of-alice", alice, {})
    assert await take(of_alice, 1) == [mine]
    assert [e.session_id for e in await take(of_everyone, 3)] == ["of-bob", None, "of-alice"]
    assert not Scope().allows(mine)  # a scope of nobody (no owner) sees nothing


async def test_a_subscriber_too_far_behind_is_dropped_after_what_it_was_sent():
    bus = EventBus(first_id=1, subscriber_bound=4)
    slow = bus.subscribe(EVERYONE)
    fast = bus.subscribe(EVERYONE)
    for i in range(10):
        bus.publish("cell.finished", f"s{i}", None, {})
        assert (await fast.next(WAIT_S)) is not None  # keeps up
    assert bus.subscriber_count == 1  # the slow one is gone: it holds nothing more
    assert [e.id for e in await take(slow, 4)] == [1, 2, 3, 4]
    with pytest.raises(SubscriptionEnded) as ended:
        await slow.next(WAIT_S)
    assert ended.value.overflowed
    assert "Last-Event-ID" in str(ended.value)
    assert slow.last_id == 4  # where it may resume from


async def test_a_listener_gets_each_event_and_its_failure_does_not_reach_the_publisher():
    bus = EventBus(first_id=1)
    heard: list[int] = []

    def broken(event: Any) -> None:
        raise RuntimeError("a listener's bug")

    bus.listen(broken)
    bus.listen(lambda event: heard.append(event.id))
    assert publish_n(bus, 2) == heard == [1, 2]


async def test_a_subscriber_with_nothing_to_take_is_told_so_after_its_timeout():
    bus = EventBus(first_id=1)
    subscription = bus.subscribe(EVERYONE)
    assert await subscription.next(0.01) is None
    subscription.close()
    assert bus.subscriber_count == 0


async def test_closing_the_bus_ends_subscriptions_after_what_they_had_queued():
    bus = EventBus(first_id=1)
    subscription = bus.subscribe(EVERYONE)
    publish_n(bus, 2)
    bus.close()
    assert len(await take(subscription, 2)) == 2
    with pytest.raises(SubscriptionEnded) as ended:
        await subscription.next(WAIT_S)
    assert not ended.value.overflowed
    with pytest.raises(SubscriptionEnded):  # and one that comes later ends at once
        await bus.subscribe(EVERYONE).next(WAIT_S)


# -- SSE frames --------------------------------------------------------------------------------


def parse_frame(raw: bytes) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for line in raw.decode().strip("\n").split("\n"):
        name, _, value = line.partition(": ")
        fields[name] = value
    if "data" in fields:
        fields["data"] = json.loads(fields["data"])
    return fields


async def test_frames_carry_id_type_and_the_event_then_heartbeats():
    bus = EventBus(first_id=7)
    frames = _frames(bus.subscribe(EVERYONE), heartbeat_s=0.01)
    assert await anext(frames) == b": subscribed\n\n"
    bus.publish("session.created", "s1", None, {"profile": "lean"})
    frame = parse_frame(await anext(frames))
    assert frame["id"] == "7"
    assert frame["event"] == "session.created"
    assert frame["data"]["id"] == 7
    assert frame["data"]["data"] == {"profile": "lean"}
    assert await anext(frames) == b": heartbeat\n\n"
    bus.close()
    with pytest.raises(StopAsyncIteration):
        await anext(frames)


async def test_frames_tell_a_gap_first_and_a_drop_last_without_ids():
    bus = EventBus(buffer=2, first_id=1, subscriber_bound=1)
    publish_n(bus, 5)
    frames = _frames(bus.subscribe(EVERYONE, after=1), heartbeat_s=WAIT_S)
    assert await anext(frames) == b": subscribed\n\n"
    gap = parse_frame(await anext(frames))
    assert "id" not in gap
    assert gap["event"] == GAP
    assert gap["data"]["type"] == GAP
    assert (gap["data"]["data"]["lost_from"], gap["data"]["data"]["lost_to"]) == (2, 3)
    assert [parse_frame(await anext(frames))["id"] for _ in range(2)] == ["4", "5"]
    publish_n(bus, 2)  # one queued, the second one too many
    assert parse_frame(await anext(frames))["id"] == "6"
    dropped = parse_frame(await anext(frames))
    assert "id" not in dropped
    assert dropped["event"] == DROPPED
    assert dropped["data"]["data"]["last_event_id"] == 6
    with pytest.raises(StopAsyncIteration):
        await anext(frames)
    assert bus.subscriber_count == 0


# -- GET /v1/events on a real server -----------------------------------------------------------

T1 = {"Authorization": "Bearer t1"}
T2 = {"Authorization": "Bearer t2"}
BOSS = {"Authorization": "Bearer boss"}
LIFE = ["session.created", "cell.started", "cell.finished", "session.closed"]


@pytest.fixture(scope="module")
def guarded(state_root) -> Iterator[ServerThread]:
    """A server with two users' tokens, t1 and t2, and an admin's, boss."""
    require_gvisor()
    config = make_config(
        state_root, tokens=frozenset({"t1", "t2"}), admin_tokens=frozenset({"boss"})
    )
    with ServerThread(config) as running:
        yield running


def client_of(server: ServerThread, headers: dict[str, str]) -> httpx.Client:
    return httpx.Client(
        base_url=f"http://127.0.0.1:{server.http_port}", headers=headers, timeout=60
    )


class Stream:
    """An open `GET /v1/events`, read frame by frame (comments kept, as `comment`)."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._lines = response.iter_lines()

    def frame(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for line in self._lines:
            if line == "":
                if fields:
                    if "data" in fields:
                        fields["data"] = json.loads(fields["data"])
                    return fields
                continue
            if line.startswith(":"):
                return {"comment": line[1:].strip()}
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")
        raise AssertionError("the stream ended")

    def events(self) -> Iterator[dict[str, Any]]:
        """Each event frame (comments skipped) until the stream ends."""
        while True:
            frame = self.frame()
            if "comment" not in frame:
                yield frame

    def until(self, predicate: Any, deadline_s: float = 60.0) -> list[dict[str, Any]]:
        """Event frames up to and including the first that predicate accepts."""
        give_up = time.monotonic() + deadline_s
        seen: list[dict[str, Any]] = []
        while time.monotonic() < give_up:  # looked at each frame, heartbeats too
            frame = self.frame()
            if "comment" not in frame:
                seen.append(frame)
                if predicate(frame):
                    return seen
        raise AssertionError(f"not seen in {deadline_s} s: {[f['event'] for f in seen]}")


@contextlib.contextmanager
def stream(
    client: httpx.Client, params: dict[str, str] | None = None, **headers: str
) -> Iterator[Stream]:
    with client.stream("GET", "/v1/events", params=params, headers=headers) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        opened = Stream(response)
        assert opened.frame() == {"comment": "subscribed"}  # subscribed: nothing missed now
        yield opened


def publish(server: ServerThread, kind: str, session_id: str | None, token: str | None) -> int:
    """An event published on the server's own bus, as the session layer would."""

    async def go() -> int:
        return server.server.events.publish(kind, session_id, owner_key(token), {}).id

    result = server.call(go())
    assert isinstance(result, int)
    return result


def of_session(session_id: str, kind: str) -> Any:
    return lambda f: f["data"]["session_id"] == session_id and f["event"] == kind


def test_a_sessions_life_is_streamed_to_its_owner(guarded):
    with client_of(guarded, T1) as http, stream(http) as events:
        session_id = http.post("/v1/sessions").json()["id"]
        cell = http.post(f"/v1/sessions/{session_id}/execute", json={"code": "1 + 1"})
        assert cell.json()["status"] == "ok"
        assert http.delete(f"/v1/sessions/{session_id}").status_code == 204
        seen = events.until(of_session(session_id, "session.closed"))
    mine = [f for f in seen if f["data"]["session_id"] == session_id]
    assert [f["event"] for f in mine] == LIFE
    ids = [int(f["id"]) for f in mine]
    assert ids == sorted(ids)
    for frame in mine:
        assert frame["data"]["type"] == frame["event"]
        assert frame["data"]["id"] == int(frame["id"])
        assert frame["data"]["owner"] == owner_key("t1")[:8]


def test_a_client_that_comes_back_with_last_event_id_misses_nothing(guarded):
    with client_of(guarded, T1) as http:
        with stream(http) as events:
            session_id = http.post("/v1/sessions").json()["id"]
            created = events.until(of_session(session_id, "session.created"))[-1]
        # Away: what happens now is kept by the server.
        http.post(f"/v1/sessions/{session_id}/execute", json={"code": "2 + 2"})
        http.delete(f"/v1/sessions/{session_id}")
        with stream(http, **{"Last-Event-ID": created["id"]}) as events:
            seen = events.until(of_session(session_id, "session.closed"))
    assert "events.gap" not in [f["event"] for f in seen]
    assert [f["event"] for f in seen if f["data"]["session_id"] == session_id] == LIFE[1:]
    assert all(int(f["id"]) > int(created["id"]) for f in seen)


def test_resuming_misses_nothing_of_what_was_published_meanwhile(guarded):
    """The same, with events put on the server's bus directly (no sandbox needed)."""
    with client_of(guarded, T1) as http:
        with stream(http, params={"session": "resume-1"}) as events:
            first = publish(guarded, "session.created", "resume-1", "t1")
            assert int(next(events.events())["id"]) == first
        meanwhile = [publish(guarded, "cell.finished", "resume-1", "t1") for _ in range(5)]
        after = str(first)
        with stream(http, params={"session": "resume-1", "last_event_id": after}) as events:
            frames = events.events()
            assert [int(next(frames)["id"]) for _ in meanwhile] == meanwhile
            live = publish(guarded, "session.closed", "resume-1", "t1")
            assert int(next(events.events())["id"]) == live


def test_the_header_wins_over_the_query_parameter(guarded):
    with client_of(guarded, T1) as http:
        ids = [publish(guarded, "cell.finished", "header-1", "t1") for _ in range(3)]
        query = {"session": "header-1", "last_event_id": str(ids[0] - 1)}
        with stream(http, params=query, **{"Last-Event-ID": str(ids[1])}) as events:
            assert int(next(events.events())["id"]) == ids[2]


def test_a_token_never_sees_another_tokens_events(guarded):
    with client_of(guarded, T2) as http, stream(http) as events:
        publish(guarded, "session.created", "of-t1", "t1")
        publish(guarded, "node.dead", None, None)  # nobody's: an admin's
        own = publish(guarded, "session.created", "of-t2", "t2")
        assert [int(f["id"]) for f in events.until(lambda f: int(f["id"]) == own)] == [own]


def test_an_admin_sees_every_tenants_events(guarded):
    with client_of(guarded, BOSS) as http, stream(http) as events:
        ids = [
            publish(guarded, "session.created", "of-t1", "t1"),
            publish(guarded, "node.dead", None, None),
            publish(guarded, "session.created", "of-t2", "t2"),
        ]
        seen = [int(f["id"]) for f in events.until(lambda f: int(f["id"]) == ids[-1])]
        assert seen == ids


def test_types_filter_and_heartbeats(guarded):
    app = guarded.server.http.app  # type: ignore[union-attr]
    app.state.events_heartbeat_s = 0.2
    try:
        with client_of(guarded, T1) as http:
            params = {"types": "cell.started, session.closed", "session": "typed-1"}
            with stream(http, params=params) as events:
                publish(guarded, "cell.finished", "typed-1", "t1")
                closed = publish(guarded, "session.closed", "typed-1", "t1")
                assert int(next(events.events())["id"]) == closed
                assert events.frame() == {"comment": "heartbeat"}
    finally:
        app.state.events_heartbeat_s = 15.0


@pytest.mark.parametrize(
    ("params", "headers", "word"),
    [
        ({"types": "session.created,session.exploded"}, {}, "session.exploded"),
        ({"last_event_id": "soon"}, {}, "last_event_id"),
        ({"last_event_id": "-1"}, {}, "last_event_id"),
        ({}, {"Last-Event-ID": "abc"}, "Last-Event-ID"),
    ],
)
def test_malformed_requests_are_400_with_a_reason(guarded, params, headers, word):
    with client_of(guarded, T1) as http:
        response = http.get("/v1/events", params=params, headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request"
    assert word in response.json()["error"]["message"]


def test_no_token_is_401(guarded):
    with client_of(guarded, {}) as http:
        assert http.get("/v1/events").status_code == 401


def test_stopping_the_server_ends_open_streams(make_server):
    server = make_server(pool_size=1)
    with client_of(server, {}) as http, stream(http) as events:
        stopper = asyncio.run_coroutine_threadsafe(server.server.stop(), server.loop)
        with pytest.raises(AssertionError, match="the stream ended"):
            while True:
                events.frame()
        stopper.result(120)


def test_a_fork_is_told_as_forked_with_the_original_and_its_copies(guarded):
    with client_of(guarded, T1) as http, stream(http) as events:
        original = http.post("/v1/sessions").json()["id"]
        forked = http.post(f"/v1/sessions/{original}/fork", json={"count": 2}, timeout=180)
        assert forked.status_code == 201, forked.text
        copies = [copy["id"] for copy in forked.json()["sessions"]]
        seen = events.until(of_session(original, "session.forked"), deadline_s=120)
        for session_id in [original, *copies]:
            assert http.delete(f"/v1/sessions/{session_id}").status_code == 204
    told = seen[-1]["data"]
    assert told["owner"] == owner_key("t1")[:8]
    assert told["data"]["copies"] == copies
    assert told["data"]["profile"] == "lean"
    # The copies are new sessions too, each told once as created, from the original.
    made = [f["data"] for f in seen if f["event"] == "session.created"]
    assert [e["session_id"] for e in made if e["session_id"] in copies] == copies
    assert all(e["data"]["forked_from"] == original for e in made if e["session_id"] in copies)
