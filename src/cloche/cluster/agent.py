"""A node agent: one per machine of the cluster, holding that machine's sessions.

It is this node's `LocalSessionManager` (sandboxes, pools, paused sessions, snapshots),
served to front ends over the data path (`cluster/link.py`; what it answers about its
sessions is `cluster/requests.py`), with its sessions' events kept
for them to take (`cluster/relay.py`), and, through Ray, the verbs that move sessions
between nodes. It runs as a Ray actor pinned to its node
(`cluster/engine.py` makes it one); nothing here imports Ray, so it is tested without.

Fencing: a node whose heartbeats went unanswered (its process frozen, SIGSTOPped, cut off)
is declared dead by a front end, for good, and its sessions are told lost. If it comes back,
its agent learns so from the directory (`Membership`, asked every MEMBERSHIP_CHECK_S),
serves nothing more, closes every session it held and deletes their paused images and its
snapshots (reported lost: none may come back), says so, and ends its process. A front end
then starts a new agent on that machine, as it does for a new one: a new node id (and
certificate), nothing on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import itertools
import logging
import os
import select
import signal
from collections.abc import AsyncGenerator, Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

from cloche.cluster.command_requests import CommandRequests
from cloche.cluster.directory import DEAD
from cloche.cluster.link import AgentServer
from cloche.cluster.relay import Outbox, Told
from cloche.cluster.requests import SessionRequests
from cloche.cluster.tls import AgentTLS
from cloche.config import ServerConfig
from cloche.errors import ClocheError, SessionLost
from cloche.llm.bridge import SessionsLLM
from cloche.llm.broker import Broker
from cloche.sandbox.registry import create_backend
from cloche.sessions.kernel import EventCallback
from cloche.sessions.local import LocalSessionManager
from cloche.sessions.observer import EventSink, Observer
from cloche.sessions.store import RecordState, SessionRecord, SnapshotRecord

if TYPE_CHECKING:
    from cloche.network.egress.service import Egress

log = logging.getLogger("cloche.cluster")
MEMBERSHIP_CHECK_S = 1.0  # how often an agent asks the directory whether it was declared dead
MEMBERSHIP_WAIT_S = 10.0  # an answer slower than this (Ray busy, a partition): asked again
# A successor's wait for its predecessor's process to end (a Ray worker given SIGTERM is
# dead to Ray as it starts finalizing, while it still holds its state directory).
PREDECESSOR_END_S = 60.0


def memory_available_bytes() -> int:
    """MemAvailable of this machine (0 when it can't be read)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _node_egress(
    config: ServerConfig, figures: NodeFigures | None, ca: tuple[bytes, bytes] | None
) -> Egress | None:
    """This node's egress (with --egress-policy): its own doors and audit file, the policy
    and secrets files read at the same paths on every node (a mounted Secret on Kubernetes)."""
    if config.egress_policy is None:
        return None
    from cloche.network.egress.service import Egress

    audit = config.egress_audit or config.data_dir / "egress" / "audit.jsonl"
    report = getattr(figures, "egress_record", None)
    return Egress.load(config.egress_policy, audit, report, config.egress_secrets, ca)


def wait_ended(pid: int, timeout_s: float) -> bool:
    """Wait (blocking) for a process of this machine, not a child of this one, to end;
    whether it did within timeout_s."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ended, _, _ = select.select([handle], [], [], timeout_s)
        return bool(ended)
    finally:
        os.close(handle)


def _watch_sigterm(agent: NodeAgent) -> None:
    """Mark the agent leaving the moment its process gets SIGTERM. Its sandboxes die within
    ~0.1 s of it, while the agent still answers for a second or two; without the mark their
    cells were answered "killed by SIGKILL ... memory", then "not found".

    An actor is made, and runs, off the worker's main thread, where no signal handler may
    be set (Ray's own, there, raises SystemExit). faulthandler may register from any
    thread, at the C level, chained to the handler before it: on SIGTERM it writes a
    traceback to a pipe, and the pipe's first byte tells the agent's loop."""
    out, into = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    faulthandler.register(signal.SIGTERM, file=into, all_threads=False, chain=True)

    def leaving() -> None:
        if agent.leaving is None:
            agent.leaving = "its node is shutting down (SIGTERM)"
            log.warning("node agent %s: SIGTERM; its sessions are lost", agent.node_id)
        with contextlib.suppress(OSError):
            os.read(out, 65536)

    asyncio.get_running_loop().add_reader(out, leaving)


class NodeFigures(Protocol):
    """What an agent reports to, when it is given one: an observer of its manager (the
    server's Prometheus metrics, made with where its events go on to) that also reads the
    manager's state and renders it all."""

    def watch(self, manager: LocalSessionManager) -> None: ...

    def render(self) -> bytes: ...

    def events_dropped(self, count: int) -> None: ...


class Membership(Protocol):
    """The cluster's word on this node, from its directory (over Ray: `cluster/engine.py`)."""

    async def state(self, node_id: str) -> str | None:
        """The node's state there (alive, draining, dead; None before it joined)."""
        ...

    async def fenced(self, node_id: str) -> None:
        """Tell it the dead node holds nothing any more: its machine may have a new agent."""
        ...

    def exit(self) -> None:
        """End this agent's process (a new agent takes its place)."""
        ...


class NodeAgent(SessionRequests, CommandRequests):
    """This node's sessions, served to front ends."""

    def __init__(
        self,
        config: ServerConfig,
        node_id: str,
        secret: str,
        host: str,
        figures: Callable[[EventSink], NodeFigures] | None = None,
        egress_ca: tuple[bytes, bytes] | None = None,
        watch_sigterm: bool = False,
        tls: AgentTLS | None = None,
        membership: Membership | None = None,
        predecessor: int | None = None,
    ) -> None:
        """membership: where the agent learns that it was declared dead (none: it never
        fences itself, as in tests of the data path); predecessor: the pid of this
        machine's agent before, declared dead: this one waits for that process to end,
        then its start cleans what it left (sandboxes, mounts, cgroups: one killed or
        ended by Ray did not stop) and deletes what it kept in --data-dir (paused sessions,
        snapshots: told lost)."""
        self.config = config
        self.node_id = node_id
        self.host = host
        # Its sessions' events, kept for the front ends to take (`events_since`).
        self.outbox = Outbox(config.events_buffer, self._events_dropped)
        # This node's figures (the server's Prometheus metrics, given by the front end that
        # made the agent), for the front ends' /metrics; none without.
        self.figures = figures(self._tell) if figures is not None else None
        observer = self.figures if isinstance(self.figures, Observer) else Told(self._tell)
        self.egress = _node_egress(config, self.figures, egress_ca)  # this node's doors
        self.broker: Broker | None = None  # llm_query for this node's cells
        llm = None
        if config.llm is not None:
            self.broker = Broker(config.llm, observer)
            llm = SessionsLLM(self.broker, config.max_frame_bytes)
        self.manager = LocalSessionManager(
            config, create_backend(config), observer=observer, egress=self.egress, llm=llm
        )
        if self.figures is not None:
            self.figures.watch(self.manager)
        # The data path's mutual TLS (None only where a test serves it on loopback in clear).
        context = tls.server_context() if tls is not None else None
        self.server = AgentServer(node_id, secret, self._handle, self._greeting, tls=context)
        self.port = 0
        self._started: asyncio.Task[None] | None = None
        self._streams: dict[int, Any] = {}  # open streamed files, by handle
        self._reads: dict[int, AsyncGenerator[bytes, None]] = {}  # files being read, by handle
        self._stream_numbers = itertools.count(1)
        self._seq = itertools.count(1)
        # Why this node is going away (its process got SIGTERM), once it is: its sandboxes
        # die with it, and what they answer then ("killed", "not found") is not the story.
        self.leaving: str | None = None
        self._watch_sigterm = watch_sigterm  # in a process of its own (a Ray actor's)
        self._membership = membership
        self._predecessor = predecessor
        self._watching: asyncio.Task[None] | None = None
        # Why the cluster declared this node dead, once the agent learnt it (it fences).
        self.fenced: str | None = None

    async def start(self) -> dict[str, Any]:
        """Start the manager and the data path once; where front ends reach it."""
        if self._started is None:
            self._started = asyncio.create_task(self._start())
        await asyncio.shield(self._started)
        return self.describe()

    async def _start(self) -> None:
        if self._watch_sigterm:
            _watch_sigterm(self)
        if self._predecessor is not None and self._predecessor != os.getpid():  # not reused
            await self._outlive(self._predecessor)
        # The manager's start cleans what an ended predecessor left (its runsc, mounts and
        # cgroups, as a restarted server's does); a successor's forgets its sessions too.
        await self.manager.start(forget=self._predecessor is not None)
        self.port = await self.server.start(self.host, self.config.cluster_agent_port)
        log.info("node agent %s serving on %s:%d", self.node_id, self.host, self.port)
        if self._membership is not None:
            self._watching = asyncio.create_task(self._watch_membership(self._membership))

    async def _outlive(self, pid: int) -> None:
        """Wait for this machine's agent before to end: until then it holds its state
        directory, and what it left there can't be cleaned."""
        log.info("node agent %s: waiting for its predecessor (pid %d) to end", self.node_id, pid)
        if not await asyncio.to_thread(wait_ended, pid, PREDECESSOR_END_S):
            log.error(
                "node agent %s: its predecessor (pid %d) has not ended in %g s: what it left "
                "stays until the next agent's start (or a local cluster's stop)",
                self.node_id, pid, PREDECESSOR_END_S,
            )  # fmt: skip

    async def _watch_membership(self, membership: Membership) -> None:
        """Ask the directory, every MEMBERSHIP_CHECK_S, whether this node was declared dead
        (after a freeze, the first ask is at once); fence it when it was."""
        while True:
            await asyncio.sleep(MEMBERSHIP_CHECK_S)
            try:
                state = await asyncio.wait_for(membership.state(self.node_id), MEMBERSHIP_WAIT_S)
            except Exception as exc:  # the directory out of reach: the verdict can wait
                log.warning("node agent %s: the directory did not answer: %s", self.node_id, exc)
                continue
            if state == DEAD:
                await self.fence("its node failed")  # as the front ends say it
                return

    async def fence(self, why: str) -> None:
        """Stop being this node, which the cluster declared dead and whose sessions it told
        lost: serve nothing more, close every session and delete every paused image and
        snapshot held here, tell the directory, and end this process."""
        if self.fenced is not None:
            return
        self.fenced = why
        log.warning("node agent %s was declared dead (%s): fencing it", self.node_id, why)
        await self.server.close()  # any front end still linked to it learns it is gone
        try:
            closed = await self.manager.abandon("node_lost")
        except Exception:  # what stays might come back: no new agent here, an operator's call
            log.exception("node agent %s: fencing failed; it stays, serving nothing", self.node_id)
            return
        if self.egress is not None:
            self.egress.close()
        if self.broker is not None:
            await self.broker.close()
        log.warning("node agent %s fenced: %d sessions closed, nothing kept", self.node_id, closed)
        if self._membership is not None:
            try:
                await asyncio.wait_for(self._membership.fenced(self.node_id), MEMBERSHIP_WAIT_S)
            except Exception as exc:  # its machine gets no new agent until a front end sees
                log.error("node agent %s: the directory was not told: %s", self.node_id, exc)
            self._membership.exit()

    def _tell(
        self,
        kind: str,
        session_id: str | None,
        owner_key: str | None,
        data: dict[str, Any],
        webhooks: frozenset[str] | None = None,
    ) -> None:
        """An event of this node's sessions, kept for the front ends (it never waits; the
        front ends deliver it to webhooks, as `events_since` shares it out)."""
        gone = self.leaving or self.fenced
        if gone is not None and kind == "session.closed":
            # Its sandbox died because the node is going: lost with its node, as its
            # requests answer.
            data = {**data, "end_reason": "node_lost", "why": gone}
        self.outbox.add(kind, session_id, owner_key, data)

    def _events_dropped(self, count: int) -> None:
        if self.figures is not None:
            self.figures.events_dropped(count)

    def _greeting(self) -> dict[str, Any]:
        """What a front end is told as it connects: where its events start (after those
        some front end has taken)."""
        return {"events": self.outbox.taken}

    def describe(self) -> dict[str, Any]:
        return {"id": self.node_id, "host": self.host, "port": self.port, "pid": os.getpid()}

    async def stop(self) -> None:
        """Close the data path, then every session (paused to --data-dir, as a server does)."""
        if self.fenced is not None:
            return  # it holds nothing, and its process ends
        if self._watching is not None:
            self._watching.cancel()
        await self.server.close()
        await self.manager.stop()
        if self.egress is not None:
            self.egress.close()
        if self.broker is not None:
            await self.broker.close()

    def stats(self) -> dict[str, Any]:
        """What placement and GET /v1/cluster need; `seq` orders answers from this agent."""
        manager = self.manager
        return {
            "seq": next(self._seq),
            "sessions": manager.live_count,
            "paused": manager.paused_count,
            "max_sessions": self.config.max_sessions,
            "pool": {name: pool.ready_count for name, pool in manager.pools.items()},
            "memory_available_bytes": memory_available_bytes(),
            "healthy": manager.healthy,
            "ended_seq": manager.ended_seq,  # sessions that expired here, counted
            "events_dropped": self.outbox.dropped,  # before a front end took them
            "pid": os.getpid(),
        }

    # -- moving sessions (called through Ray; images go through its object store) ------

    async def export_session(self, session_id: str) -> tuple[dict[str, Any], bytes]:
        record, image = await self.manager.export_session(session_id)
        raw = asdict(record)
        raw["state"] = record.state.value
        return raw, image

    async def adopt_session(self, raw: dict[str, Any], image: bytes) -> None:
        if self.fenced is not None:
            raise ClocheError(f"node {self.node_id} was declared dead: it takes nothing in")
        record = SessionRecord(**{**raw, "state": RecordState(raw["state"])})
        await self.manager.adopt_session(record, bytes(image))

    async def release_session(self, session_id: str, moved: bool) -> None:
        await self.manager.release_session(session_id, moved=moved)

    async def export_snapshot(self, snapshot_id: str) -> tuple[dict[str, Any], bytes]:
        record, image = await self.manager.export_snapshot(snapshot_id)
        return asdict(record), image

    async def adopt_snapshot(self, raw: dict[str, Any], image: bytes) -> None:
        if self.fenced is not None:
            raise ClocheError(f"node {self.node_id} was declared dead: it takes nothing in")
        await self.manager.adopt_snapshot(SnapshotRecord(**raw), bytes(image))

    def held(self) -> tuple[list[str], list[str]]:
        """The ids of every session (paused ones too) and snapshot here: what a drain moves."""
        return self.manager.session_ids(), self.manager.snapshot_ids()

    # -- the data path --------------------------------------------------------------------

    async def _handle(self, op: str, args: dict[str, Any], on_event: EventCallback) -> Any:
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            raise ClocheError(f"unknown data-path request {op!r}")
        session_id = args.get("session_id")
        self._check_leaving(session_id)
        try:
            answer = await handler(on_event=on_event, **args)
        except ClocheError:
            self._check_leaving(session_id)  # a session that died with its node: lost
            raise
        self._check_leaving(session_id)  # a cell killed as its node went: lost, not killed
        return answer

    def _check_leaving(self, session_id: object) -> None:
        gone = self.leaving or self.fenced
        if gone is not None and isinstance(session_id, str):
            lost = SessionLost(session_id)
            lost.args = (f"Session {session_id} was lost: {gone}",)
            raise lost
        if self.fenced is not None:
            raise ClocheError(f"node {self.node_id} was declared dead: it serves nothing")

    async def _op_stats(self, on_event: EventCallback) -> dict[str, Any]:
        return self.stats()

    async def _op_ended_since(self, on_event: EventCallback, seq: int) -> dict[str, Any]:
        """Sessions that expired here since seq (idle timeout, lifetime): for the directory."""
        return {"seq": self.manager.ended_seq, "ids": self.manager.ended_since(seq)}

    async def _op_events_since(
        self,
        on_event: EventCallback,
        seq: int,
        limit: int,
        wait_s: float,
        claim: list[str] | None = None,
    ) -> dict[str, Any]:
        """This node's events after number seq, for a front end's bus (a long poll), and
        which of them are its to deliver to the webhook receivers it names in claim."""
        return await self.outbox.since(seq, limit, wait_s, claim or ())

    async def _op_holds(self, on_event: EventCallback, session_id: str) -> bool:
        """Whether this node holds the session, whoever owns it (a front end looking for it)."""
        return session_id in self.manager.session_ids()

    async def _op_metrics(self, on_event: EventCallback) -> str:
        return self.figures.render().decode() if self.figures is not None else ""

    async def _op_profiles(self, on_event: EventCallback) -> Any:
        return self.manager.profiles()
