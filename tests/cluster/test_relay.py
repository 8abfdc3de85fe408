"""A node's session events on their way to the front ends' buses, without Ray or a sandbox:
the agent's outbox, the front end's relay over a real data path, and what a front end tells
when a node dies (the real cluster is in test_cluster_events.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cloche.cluster.agent import NodeAgent
from cloche.cluster.directory import ALIVE, DEAD
from cloche.cluster.link import AgentLink, AgentServer
from cloche.cluster.manager import ClusterSessionManager
from cloche.cluster.members import Node
from cloche.cluster.relay import Outbox, relay
from cloche.sessions.kernel import EventCallback
from cloche.sessions.observer import Observer
from support import make_config

from .test_drain_report import Agent, Call, Directory

SECRET = "s" * 64
Told = tuple[str, str | None, str | None, dict[str, Any]]


def numbers(answer: dict[str, Any]) -> list[int]:
    return [event[0] for event in answer["events"]]


def fill(outbox: Outbox, *session_ids: str) -> None:
    for session_id in session_ids:
        outbox.add("cell.finished", session_id, "key", {"execution_count": 1})


# -- the agent's outbox ------------------------------------------------------------------


async def test_events_come_back_in_order_after_the_number_asked_at_most_limit_at_once() -> None:
    outbox = Outbox(100)
    fill(outbox, "s1", "s2", "s3", "s4", "s5")
    first = await outbox.since(0, limit=3)
    assert numbers(first) == [1, 2, 3] and first["seq"] == 3
    assert first["events"][0] == [1, "cell.finished", "s1", "key", {"execution_count": 1}]
    rest = await outbox.since(first["seq"], limit=3)
    assert numbers(rest) == [4, 5] and rest["seq"] == 5
    assert await outbox.since(5) == {"seq": 5, "events": []}
    assert outbox.taken == 5 and outbox.dropped == 0


async def test_a_poll_with_nothing_new_waits_for_the_next_event() -> None:
    outbox = Outbox(100)
    fill(outbox, "s1")
    polls = [asyncio.create_task(outbox.since(1, wait_s=60)) for _ in range(2)]
    await asyncio.sleep(0)  # one turn of the loop: each runs up to its wait
    assert outbox._polled == 2 and not any(poll.done() for poll in polls)
    fill(outbox, "s2")
    for poll in polls:  # each woken by it, long before its wait is up
        answer = await asyncio.wait_for(poll, 30)
        assert numbers(answer) == [2]
    empty = await outbox.since(2, wait_s=0.01)  # and a poll that nothing wakes ends empty
    assert empty == {"seq": 2, "events": []}


async def test_a_full_outbox_drops_its_oldest_counting_those_no_front_end_took() -> None:
    drops: list[int] = []
    outbox = Outbox(3, drops.append)
    fill(outbox, "s1", "s2")
    assert numbers(await outbox.since(0)) == [1, 2]  # taken: pushing them out loses nothing
    fill(outbox, "s3", "s4", "s5")
    assert outbox.dropped == 0 and drops == []
    fill(outbox, "s6", "s7")  # 3 and 4 go, untaken
    assert outbox.dropped == 2 and drops == [1, 1]
    assert numbers(await outbox.since(2)) == [5, 6, 7]  # from the oldest still kept


async def test_each_event_is_given_out_once_for_each_webhook_receiver() -> None:
    """Front ends that name a receiver in their polls: the first to take an event delivers
    it there; the others take it too (for their streams), not for that receiver."""
    outbox = Outbox(100)
    fill(outbox, "s1", "s2", "s3")
    first = await outbox.since(0, limit=2, claim=["hook-a"])
    assert numbers(first) == [1, 2] and first["claimed"] == {"hook-a": 0}
    second = await outbox.since(0, claim=["hook-a", "hook-b"])  # another front end
    assert numbers(second) == [1, 2, 3] and second["claimed"] == {"hook-a": 2, "hook-b": 0}
    again = await outbox.since(2, claim=["hook-a"])  # the first, further on
    assert numbers(again) == [3] and again["claimed"] == {"hook-a": 3}
    assert "claimed" not in await outbox.since(0)  # a front end without webhooks


# -- the front end's relay, over the data path --------------------------------------------


class Served:
    """An agent's data path serving an outbox (as NodeAgent does), and its greeting."""

    def __init__(self) -> None:
        self.outbox = Outbox(1000)
        self.server = AgentServer("node-a", SECRET, self.handle, self.greeting)

    def greeting(self) -> dict[str, Any]:
        return {"events": self.outbox.taken}

    async def handle(self, op: str, args: dict[str, Any], on_event: EventCallback) -> Any:
        if op == "stats":
            return {"seq": 1}
        assert op == "events_since", op
        return await self.outbox.since(**args)


@pytest.fixture
async def served() -> AsyncIterator[tuple[Served, int]]:
    agent = Served()
    port = await agent.server.start("127.0.0.1", 0)
    yield agent, port
    await agent.server.close()


class Heard:
    """A relay's sink: what it was told, and a wait for the next."""

    def __init__(self) -> None:
        self.told: list[Told] = []
        self.webhooks: list[frozenset[str] | None] = []  # the receivers each was given for
        self.news = asyncio.Event()

    def __call__(
        self,
        kind: str,
        session_id: str | None,
        owner_key: str | None,
        data: dict[str, Any],
        webhooks: frozenset[str] | None = None,
    ) -> None:
        self.told.append((kind, session_id, owner_key, data))
        self.webhooks.append(webhooks)
        self.news.set()

    async def until(self, count: int) -> list[str | None]:
        async with asyncio.timeout(30):
            while len(self.told) < count:
                self.news.clear()
                await self.news.wait()
        return [session_id for _, session_id, _, _ in self.told]


async def connect(port: int) -> AgentLink:
    link = AgentLink("node-a", "127.0.0.1", port, SECRET, lambda *_: None, lambda *_: None)
    await link.connect()
    return link


async def test_a_relay_tells_each_event_once_in_order_from_what_none_took(served) -> None:
    agent, port = served
    fill(agent.outbox, "before-1", "before-2")  # no front end yet: kept for the first
    first_link = await connect(port)
    assert first_link.greeting["events"] == 0
    first = Heard()
    relaying = [asyncio.create_task(relay(first_link, first_link.greeting["events"], first))]
    assert await first.until(2) == ["before-1", "before-2"]
    # A second front end starts at what the first has taken: not the node's past.
    second_link = await connect(port)
    assert second_link.greeting["events"] == 2
    second = Heard()
    relaying.append(asyncio.create_task(relay(second_link, 2, second)))
    fill(agent.outbox, *(f"s{n}" for n in range(600)))  # more than one poll's answer
    assert await first.until(602) == ["before-1", "before-2", *(f"s{n}" for n in range(600))]
    assert await second.until(600) == [f"s{n}" for n in range(600)]
    assert first.told[2] == ("cell.finished", "s0", "key", {"execution_count": 1})
    # The link goes down (the agent died): each relay ends.
    await agent.server.close()
    await asyncio.wait_for(asyncio.gather(*relaying), 30)
    assert len(first.told) == 602 and len(second.told) == 600
    for link in (first_link, second_link):
        link.close()


async def test_two_relays_naming_one_webhook_are_each_given_each_event_for_it_once(
    served,
) -> None:
    agent, port = served
    links = [await connect(port) for _ in range(2)]
    heard = [Heard(), Heard()]
    relaying = [
        asyncio.create_task(relay(link, 0, sink, frozenset({"hook", f"own-{i}"})))
        for i, (link, sink) in enumerate(zip(links, heard, strict=True))
    ]
    fill(agent.outbox, *(f"s{n}" for n in range(300)))
    for sink in heard:  # both tell every event, in order
        assert await sink.until(300) == [f"s{n}" for n in range(300)]
    for n in range(300):  # the shared receiver gets it from one; each its own from itself
        given = [sink.webhooks[n] for sink in heard]
        assert [g is not None and "hook" in g for g in given].count(True) == 1, n
        assert [g is not None and f"own-{i}" in g for i, g in enumerate(given)] == [True] * 2
    for link in links:
        link.close()
    await asyncio.wait_for(asyncio.gather(*relaying), 30)


async def test_a_relay_says_how_many_events_it_missed_and_goes_on(served, caplog) -> None:
    agent, port = served
    agent.outbox = Outbox(2)
    fill(agent.outbox, "s1", "s2", "s3", "s4")  # no front end took 1 and 2
    link = await connect(port)
    heard = Heard()
    with caplog.at_level(logging.WARNING, logger="cloche.cluster"):
        relaying = asyncio.create_task(relay(link, 0, heard))
        assert await heard.until(2) == ["s3", "s4"]
    assert "node node-a dropped 2 events" in caplog.text
    link.close()
    await asyncio.wait_for(relaying, 30)


# -- the node agent ----------------------------------------------------------------------


async def test_an_agent_keeps_its_sessions_events_and_a_leaving_one_tells_them_lost(
    tmp_path: Path,
) -> None:
    agent = NodeAgent(make_config(tmp_path), "node-1", "secret", "127.0.0.1")
    observer = agent.manager.observer  # what its session layer reports to
    observer.event("session.created", "s1", "key", {"profile": "lean"})
    observer.event("session.closed", "s1", "key", {"end_reason": "closed"})
    agent.leaving = "its node is shutting down (SIGTERM)"
    observer.event("session.closed", "s2", "key", {"end_reason": "sandbox_died"})
    answer = await agent._handle(
        "events_since", {"seq": 0, "limit": 10, "wait_s": 0}, lambda event: None
    )
    assert [event[1:3] for event in answer["events"]] == [
        ["session.created", "s1"],
        ["session.closed", "s1"],
        ["session.closed", "s2"],
    ]
    assert answer["events"][1][4] == {"end_reason": "closed"}
    assert answer["events"][2][4] == {
        "end_reason": "node_lost",
        "why": "its node is shutting down (SIGTERM)",
    }
    assert agent._greeting() == {"events": 3}  # a front end that comes now starts after


# -- what a front end tells -----------------------------------------------------------------


class Watcher(Observer):
    def __init__(self) -> None:
        self.events: list[Told] = []
        self.ends: list[tuple[str, str]] = []

    def event(
        self,
        kind: str,
        session_id: str | None,
        owner_key: str | None,
        data: dict[str, Any],
        webhooks: frozenset[str] | None = None,
    ) -> None:
        self.events.append((kind, session_id, owner_key, data))

    def session_closed(self, reason: str, end_reason: str = "closed") -> None:
        self.ends.append((reason, end_reason))


class Link:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id

    def heard(self) -> None:
        pass

    def close(self, why: str) -> None:
        pass


def make_node(node_id: str) -> Node:
    return Node(node_id, node_id, "127.0.0.1", 7100, 1, Agent(), Link(node_id), ALIVE, {})


async def test_a_dead_node_s_sessions_are_told_closed_node_lost_once(tmp_path: Path) -> None:
    watcher = Watcher()
    manager = ClusterSessionManager(make_config(tmp_path, cluster="local:2"), watcher)
    directory = Directory()
    # s4 moved to node b (a drain) after a's events said it was there.
    directory.nodes_of = Call({"s1": "a", "s2": None, "s4": "b"})  # type: ignore[attr-defined]
    manager.engine.directory = directory
    a, b = make_node("a"), make_node("b")
    manager.nodes = {"a": a, "b": b}
    a.residents = {"s1": "k1"}  # held when the front end joined
    for kind, session_id in [
        ("session.created", "s2"),
        ("cell.finished", "s2"),
        ("session.created", "s3"),
        ("session.closed", "s3"),  # closed: not lost
        ("session.paused", "s4"),
    ]:
        manager._relayed(a, kind, session_id, "k2", {"n": 1})
    manager._relayed(b, "session.created", "s5", "k5", {})
    assert [data["node"] for _, _, _, data in watcher.events] == ["a"] * 5 + ["b"]
    assert watcher.events[1] == ("cell.finished", "s2", "k2", {"n": 1, "node": "a"})
    assert a.residents == {"s1": "k1", "s2": "k2", "s4": "k2"}
    watcher.events.clear()

    manager._link_down(a.link, "its connection closed")  # type: ignore[arg-type]
    manager._set_state(a, DEAD, tell=False)  # another front end's verdict, too
    await asyncio.gather(*manager._background)
    lost = [e for e in watcher.events if e[0] == "session.closed"]
    assert sorted(lost, key=lambda e: str(e[1])) == [
        ("session.closed", "s1", "k1", {"end_reason": "node_lost", "reason": "lost", "node": "a"}),
        ("session.closed", "s2", "k2", {"end_reason": "node_lost", "reason": "lost", "node": "a"}),
    ]
    assert watcher.ends == [("lost", "node_lost")] * 2
    assert [e[0] for e in watcher.events if e[0] != "session.closed"] == ["node.dead"]
    assert b.residents == {"s5": "k5"}  # the other node's are untouched
