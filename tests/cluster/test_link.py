"""The data path between a front end and a node agent, without Ray or a sandbox."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cloche.cluster import link as link_module
from cloche.cluster.link import AgentLink, AgentServer, LinkDown
from cloche.errors import PathRefused, SessionLost, SessionNotFound
from cloche.sessions.kernel import EventCallback

SECRET = "s" * 64


class Agent:
    """A handler that answers as an agent would, and records what it was asked."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.stats_hang = False

    async def __call__(self, op: str, args: dict[str, Any], on_event: EventCallback) -> Any:
        if op == "stats":
            if self.stats_hang:
                await asyncio.Event().wait()
            return {"seq": 1, "sessions": 0}
        if op == "echo":
            for n in range(args["events"]):
                on_event({"n": n})
            return args["value"]
        if op == "missing":
            raise SessionNotFound(args["session_id"])
        if op == "refused":
            raise PathRefused("a/b", "it is a symlink")
        if op == "lost":
            lost = SessionLost("abc")
            lost.args = ("Session abc was lost: its node failed",)
            raise lost
        if op == "forever":
            self.started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        raise AssertionError(op)


@pytest.fixture
async def served() -> AsyncIterator[tuple[AgentServer, Agent, int]]:
    agent = Agent()
    server = AgentServer("node-a", SECRET, agent)
    port = await server.start("127.0.0.1", 0)
    yield server, agent, port
    await server.close()


class Downs:
    def __init__(self) -> None:
        self.why: list[str] = []
        self.event = asyncio.Event()

    def __call__(self, link: AgentLink, why: str) -> None:
        self.why.append(why)
        self.event.set()


async def connect(port: int, secret: str = SECRET) -> tuple[AgentLink, Downs]:
    downs = Downs()
    link = AgentLink("node-a", "127.0.0.1", port, secret, downs, lambda link, stats: None)
    await link.connect()
    return link, downs


async def test_a_request_gets_its_answer_and_its_events_in_order(served) -> None:
    _, _, port = served
    link, _ = await connect(port)
    events: list[dict[str, Any]] = []
    assert await link.call("echo", {"value": [1, "x"], "events": 3}, events.append) == [1, "x"]
    assert events == [{"n": 0}, {"n": 1}, {"n": 2}]
    link.close()


async def test_many_requests_share_one_connection(served) -> None:
    _, _, port = served
    link, _ = await connect(port)
    answers = await asyncio.gather(
        *(link.call("echo", {"value": n, "events": 0}) for n in range(200))
    )
    assert answers == list(range(200))
    link.close()


async def test_errors_cross_with_their_class_and_message(served) -> None:
    _, _, port = served
    link, _ = await connect(port)
    with pytest.raises(SessionNotFound, match="Session xyz not found") as missing:
        await link.call("missing", {"session_id": "xyz"})
    assert missing.value.session_id == "xyz"
    with pytest.raises(PathRefused, match="symlink") as refused:
        await link.call("refused")
    assert refused.value.path == "a/b"
    with pytest.raises(SessionLost, match="^Session abc was lost: its node failed$"):
        await link.call("lost")
    link.close()


async def test_a_caller_that_gives_up_cancels_the_request_on_the_agent(served) -> None:
    _, agent, port = served
    link, _ = await connect(port)
    call = asyncio.create_task(link.call("forever"))
    await agent.started.wait()
    call.cancel()
    await asyncio.wait_for(agent.cancelled.wait(), 30)
    link.close()


async def test_a_front_end_without_the_secret_is_refused(served) -> None:
    _, _, port = served
    with pytest.raises(LinkDown, match="refused the cluster's secret"):
        await connect(port, secret="wrong")


async def test_an_agent_that_goes_away_fails_what_waits_and_says_so(served) -> None:
    server, agent, port = served
    link, downs = await connect(port)
    waiting = asyncio.create_task(link.call("forever"))
    await agent.started.wait()
    await server.close()  # its process died: the connection ends
    with pytest.raises(LinkDown):
        await asyncio.wait_for(waiting, 30)
    await asyncio.wait_for(downs.event.wait(), 30)
    assert downs.why and link.down is not None
    with pytest.raises(LinkDown):
        await link.call("echo", {"value": 1, "events": 0})  # down for good


async def test_an_agent_that_stops_answering_heartbeats_is_declared_down(
    served, monkeypatch
) -> None:
    _, agent, port = served
    monkeypatch.setattr(link_module, "DEADLINE_S", 0.2)
    agent.stats_hang = True  # a frozen machine: the connection stays open, nothing answers
    link, downs = await connect(port)
    await asyncio.wait_for(downs.event.wait(), 30)
    assert "heartbeat" in downs.why[0]
    assert link.down is not None


async def test_an_agent_whose_heartbeats_are_late_but_that_answers_is_not_down(
    served, monkeypatch
) -> None:
    """A starved machine: its heartbeats come later than the deadline, but it answers other
    requests (or the front end hears from it over Ray): slow, not dead. Once silent for the
    deadline, it is down, and says how long it was silent and how its heartbeats went."""
    _, agent, port = served
    answered = asyncio.Event()
    downs = Downs()
    link = AgentLink("node-a", "127.0.0.1", port, SECRET, downs, lambda link, stats: answered.set())
    await link.connect()
    for _ in range(2):  # heartbeats answered at first
        answered.clear()
        await asyncio.wait_for(answered.wait(), 30)
    link.deadline_s = 0.5
    agent.stats_hang = True
    clock = asyncio.get_running_loop().time
    for keep_alive in ("another answer", "heard over Ray"):
        began = clock()
        while clock() - began < 2.0:  # four deadlines of late heartbeats
            if keep_alive == "another answer":
                assert await link.call("echo", {"value": 1, "events": 0}) == 1
            else:
                link.heard()
            await asyncio.sleep(0.1)  # the pace of what keeps it alive, not a wait
        assert link.down is None and downs.why == [], keep_alive
    await asyncio.wait_for(downs.event.wait(), 30)  # then silent: down
    assert downs.why[0].startswith("no answer for ")
    assert "(--node-deadline 0.5 s; its last heartbeats took 0.0" in downs.why[0]
