"""The cluster's nodes as one front end holds them: each node agent (`Node`) started or
found, linked over the data path, its events relayed (`cluster/relay.py`), watched, and
declared dead for good when its link goes down (its sessions then say they were lost, and
are told closed, `node_lost`).

Every front end tells what happens to the nodes (`node.up`, `node.draining`, `node.dead`,
and the sessions lost with a node) on its own stream; each webhook receiver gets each of
these once, from the front end that claimed it in the directory (named by the node's turn,
alike on every front end), as it gets each event of a node's sessions once (the relay).

The first layer of `ClusterSessionManager` (`cluster/manager.py`); where each session is,
and moving sessions off a draining node, is the next layer's (`cluster/routing.py`).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cloche.cluster.agent import NodeFigures
from cloche.cluster.directory import ALIVE, DEAD, DRAINING
from cloche.cluster.engine import Engine, RayNode
from cloche.cluster.link import AgentLink, LinkDown
from cloche.cluster.relay import relay
from cloche.cluster.tls import front_end_context
from cloche.config import ServerConfig
from cloche.errors import ClocheError, ConfigError, SessionLost
from cloche.sessions.manager import SessionManager
from cloche.sessions.observer import EventSink, Observer

log = logging.getLogger("cloche.cluster")

WATCH_S = 2.0  # how often the front end looks for new nodes and others' verdicts
AGENT_START_S = 300.0  # a node agent's start (its pools fill first)
AGENT_STOP_S = 120.0  # a node agent pausing its sessions at the cluster's stop
METRICS_WAIT_S = 2.0  # a node slower than this to give its figures is left out of a scrape
LOST_WAIT_S = 5.0  # a dead node's last events, then the directory, before its losses are told
ENDED_ASK_S = 1.0  # Ray, whether a dead node's agent ended (a frozen one does not answer)
CLAIM_WAIT_S = 5.0  # the directory's share of webhook deliveries (slower: this one delivers all)


def node_failed(session_id: str) -> SessionLost:
    """What a request about a session whose node failed raises."""
    lost = SessionLost(session_id)
    lost.args = (f"Session {session_id} was lost: its node failed",)
    return lost


@dataclass
class Node:
    """A node agent as this front end sees it."""

    id: str
    ray_id: str
    host: str
    port: int
    pid: int
    handle: Any  # its Ray actor
    link: AgentLink | None
    state: str = ALIVE
    stats: dict[str, Any] = field(default_factory=dict)
    inflight: int = 0  # sessions being created there by this front end
    ended_seen: int = 0  # its expired sessions, up to this number, are out of the directory
    collecting: bool = False  # ... and more are being asked for
    # Its sessions (paused ones too) and their owners' keys, as its events tell: those told
    # closed with `node_lost` when it dies.
    residents: dict[str, str | None] = field(default_factory=dict)
    relay: asyncio.Task[None] | None = None  # taking its events to this front end's bus
    # Its changes of state are told one after the other, each once the directory has it.
    telling: asyncio.Lock = field(default_factory=asyncio.Lock)

    def event_data(self, state: str, why: str | None = None) -> dict[str, Any]:
        """What an event about this node says (`node.up`, `node.draining`, `node.dead`)."""
        data = {"node": self.id, "address": f"{self.host}:{self.port}", "state": state}
        return data if why is None else {**data, "why": why}

    def view(self) -> dict[str, Any]:
        stats = self.stats
        return {
            "id": self.id,
            "address": f"{self.host}:{self.port}",
            "state": self.state,
            "sessions": stats.get("sessions", 0),
            "paused": stats.get("paused", 0),
            "pool": stats.get("pool", {}),
            "memory_available_bytes": stats.get("memory_available_bytes", 0),
            "pid": self.pid,
        }


class ClusterNodes(SessionManager):
    """The nodes of a Ray cluster, as this front end holds them (see `ClusterSessionManager`)."""

    def __init__(
        self,
        config: ServerConfig,
        observer: Observer | None = None,
        node_figures: Callable[[EventSink], NodeFigures] | None = None,
        webhooks: frozenset[str] = frozenset(),
    ) -> None:
        """observer: told of this front end's events (the server's metrics); node_figures:
        makes what each node agent reports to (the same kind of metrics, per node);
        webhooks: the ids of the server's webhook receivers (`Receiver.id`), whose
        deliveries of the nodes' events this front end claims its share of."""
        self.config = config
        self.webhooks = webhooks
        self.observer = observer or Observer()
        self.engine = Engine(config, node_figures)
        self.nodes: dict[str, Node] = {}
        self._where: dict[str, str] = {}  # session id -> node id, as learnt
        self._secret = ""
        self._egress_ca: tuple[bytes, bytes] | None = None  # with --secrets: the nodes' CA
        # The data path's CA (mutual TLS with the agents) and this front end's side of it.
        self._data_ca: tuple[bytes, bytes] = (b"", b"")
        self._tls: ssl.SSLContext | None = None
        self._directory_pid: int | None = None
        self._profiles: builtins.list[dict[str, Any]] = []
        self._watcher: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._stopped = False
        self.created = 0  # sessions this front end placed
        self.directory_size: dict[str, int] = {}  # as the directory said at the last look
        self._news = asyncio.Event()  # set at each new report of a node's figures

    # -- joining and watching the cluster ---------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self.engine.open)
        try:
            self._secret = await self.engine.directory.cluster_secret.remote()
            self._data_ca = await self.engine.directory.data_path_ca.remote()
            self._tls = front_end_context(self._data_ca)
            self._directory_pid = await self.engine.directory.pid.remote()
            if self.config.egress_secrets is not None:
                self._egress_ca = await self.engine.directory.interception_ca.remote()
            await self._discover()
            if not self._alive():
                raise ConfigError(
                    "no node of the Ray cluster can run sandboxes: start Ray nodes with "
                    "--resources='{\"cloche_node\": 1}'"
                )
        except BaseException:
            await self.stop()
            raise
        self._watcher = asyncio.create_task(self._watch(), name="cloche-cluster-watch")
        log.info(
            "cluster front end on Ray %s: %d nodes %s",
            self.engine.address,
            len(self.nodes),
            ", ".join(sorted(self.nodes)),
        )

    async def _discover(self) -> None:
        """Agents for new Ray nodes; links to agents others started; others' verdicts."""
        known = await self.engine.directory.all_nodes.remote()
        self.directory_size = await self.engine.directory.size.remote()
        for entry in known:
            node = self.nodes.get(entry["id"])
            if node is not None and entry["state"] != node.state and node.state != DEAD:
                self._set_state(node, entry["state"], tell=False, turn=entry.get("turn"))
        linked = {n.ray_id for n in self.nodes.values() if n.state != DEAD}
        unlinked = [r for r in await asyncio.to_thread(self.engine.nodes) if r.ray_id not in linked]
        held_back = await self._held_back(known, {r.ray_id for r in unlinked})
        # The agent each machine had last, declared dead: its successor cleans what it left.
        predecessors = {n["ray_id"]: n["pid"] for n in known if n["state"] == DEAD}
        await asyncio.gather(
            *(
                self._join(ray_node, predecessors.get(ray_node.ray_id))
                for ray_node in unlinked
                if ray_node.ray_id not in held_back
            )
        )
        for entry in known:  # dead nodes others saw, for GET /v1/cluster
            if entry["id"] not in self.nodes and entry["state"] == DEAD:
                self.nodes[entry["id"]] = Node(
                    entry["id"], entry["ray_id"], entry["host"], entry["port"], entry["pid"],
                    None, None, DEAD,
                )  # fmt: skip

    async def _held_back(
        self, known: builtins.list[dict[str, Any]], machines: set[str]
    ) -> set[str]:
        """Of the machines (Ray node ids) given, those that get no new agent yet: one of
        theirs was declared dead and may still hold sandboxes. Until it has fenced itself
        (removed all it held, and gone), or Ray says its actor died (killed -9: what it
        left, the next agent cleans)."""
        waiting = [
            entry
            for entry in known
            if entry["state"] == DEAD
            and not entry.get("fenced")
            and not entry.get("ended")
            and entry["ray_id"] in machines
        ]
        answers = await asyncio.gather(*(self._agent_ended(entry) for entry in waiting))
        held = set()
        for entry, ended in zip(waiting, answers, strict=True):
            if not ended:
                held.add(entry["ray_id"])
                continue
            log.warning(
                "the agent of dead node %s ended without fencing itself (killed?): its "
                "machine gets a new agent, which removes what it left",
                entry["id"],
            )
            await self.engine.directory.ended.remote(entry["id"])
        return held

    async def _agent_ended(self, entry: dict[str, Any]) -> bool:
        node = self.nodes.get(entry["id"])
        handle = node.handle if node is not None else None
        return await asyncio.to_thread(
            self.engine.agent_ended, entry["ray_id"], handle, ENDED_ASK_S
        )

    async def _join(self, ray_node: RayNode, predecessor: int | None = None) -> None:
        """Start (or find) a machine's agent and link it; predecessor: the pid of that
        machine's agent before, declared dead (the new one cleans what it left)."""
        handle = await asyncio.to_thread(
            self.engine.agent, ray_node, self._secret, self._egress_ca, self._data_ca, predecessor
        )
        try:
            described = await asyncio.wait_for(handle.start.remote(), AGENT_START_S)
        except Exception as exc:  # a node that can't run sandboxes: the others serve
            log.error("node agent on Ray node %s did not start: %s", ray_node.ray_id, exc)
            return
        node = Node(
            described["id"],
            ray_node.ray_id,
            described["host"],
            described["port"],
            described["pid"],
            handle,
            None,
        )
        state = await self.engine.directory.join.remote({**described, "ray_id": ray_node.ray_id})
        if state == DEAD:  # a dead node's agent, not gone yet: never linked again
            log.info("node agent %s was declared dead: not linked", node.id)
            return
        # What it holds already (paused in its --data-dir by a previous run) is found again.
        session_ids, snapshot_ids = await handle.held.remote()
        await self.engine.directory.place.remote(session_ids, node.id)
        for snapshot_id in snapshot_ids:
            await self.engine.directory.place_snapshot.remote(snapshot_id, node.id)
        link = AgentLink(
            node.id,
            node.host,
            node.port,
            self._secret,
            self._link_down,
            self._link_stats,
            tls=self._tls,
            deadline_s=self.config.node_deadline_s,
        )
        try:
            await link.connect()
        except LinkDown as exc:
            log.error("node agent %s can't be reached: %s", node.id, exc)
            return
        node.link = link
        try:  # what it holds now; its events (from its greeting's number) tell the rest
            for info in await link.call("sessions", {"owner": None, "every": True}):
                node.residents[info["id"]] = info["owner_key"]
        except (ClocheError, LinkDown) as exc:
            log.warning("node %s did not list its sessions: %s", node.id, exc)
        await self._announce(node, ALIVE, turn=0)  # its first turn, whoever tells it
        told = functools.partial(self._relayed, node)
        node.relay = asyncio.create_task(
            relay(link, link.greeting.get("events", 0), told, self.webhooks),
            name=f"events-{node.id}",
        )
        self.nodes[node.id] = node
        with contextlib.suppress(ClocheError, LinkDown):
            node.stats = await link.call("stats")
            if not self._profiles:
                self._profiles = await link.call("profiles")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                await self._discover()
            except Exception as exc:  # Ray's control plane busy: next round
                log.warning("cluster watch: %s", exc)

    def _relayed(
        self,
        node: Node,
        kind: str,
        session_id: str | None,
        owner_key: str | None,
        data: dict[str, Any],
        webhooks: frozenset[str] | None = None,
    ) -> None:
        """An event of a node's sessions, told on as this front end's own, with the node
        (delivered to the webhook receivers the relay gave it to this front end for)."""
        if session_id is not None and kind.startswith("session."):
            if kind == "session.closed":
                node.residents.pop(session_id, None)
            else:
                node.residents[session_id] = owner_key
        self.observer.event(kind, session_id, owner_key, {**data, "node": node.id}, webhooks)

    async def _claim(self, events: builtins.list[str]) -> builtins.list[frozenset[str]]:
        """For each event this front end tells of the nodes (named alike by every front
        end), the webhook receivers it is the one to deliver it to."""
        if not self.webhooks or not events:
            return [frozenset()] * len(events)
        try:
            answers = await asyncio.wait_for(
                self.engine.directory.claim.remote(events, sorted(self.webhooks)), CLAIM_WAIT_S
            )
        except Exception as exc:  # at least once, then: its webhooks may get them twice
            log.warning("the directory did not share out webhook deliveries: %s", exc)
            return [self.webhooks] * len(events)
        return [frozenset(answer) for answer in answers]

    async def _announce(
        self,
        node: Node,
        state: str,
        why: str | None = None,
        *,
        changed: bool = True,
        tell: bool = False,
        turn: int | None = None,
    ) -> None:
        """A node's new state: in the directory (tell: this front end's own verdict), then,
        if it changed here, as an event, and after a death its sessions told lost."""
        async with node.telling:
            if tell:
                try:
                    turn = await asyncio.wait_for(
                        self.engine.directory.set_state.remote(node.id, state), CLAIM_WAIT_S
                    )
                except Exception as exc:  # told anyway; others learn it at their next look
                    log.warning("the directory was not told node %s is %s: %s", node.id, state, exc)
            if not changed:
                return
            # Named alike by every front end that tells it: a node dies once; it may drain
            # and come back many times, each a turn of its own.
            name = f"{node.id} {state}" + ("" if state == DEAD else f" #{turn}")
            if turn is None and state != DEAD:  # the directory out of reach: delivered here
                webhooks = self.webhooks
            else:
                (webhooks,) = await self._claim([name])
            kind = {ALIVE: "node.up", DRAINING: "node.draining", DEAD: "node.dead"}[state]
            self.observer.event(kind, None, None, node.event_data(state, why), webhooks)
            if state == DEAD:
                await self._tell_lost(node)

    async def _tell_lost(self, node: Node) -> None:
        """Tell each session of a node declared dead closed (`node_lost`), once, after the
        node's last events; not those the directory places elsewhere now (moved by a drain)."""
        if node.relay is not None:
            await asyncio.wait([node.relay], timeout=LOST_WAIT_S)
        lost, node.residents = node.residents, {}
        if not lost:
            return
        try:
            places = await asyncio.wait_for(
                self.engine.directory.nodes_of.remote(builtins.list(lost)), LOST_WAIT_S
            )
        except Exception as exc:  # Ray's control plane busy: each is told lost
            log.warning("the directory did not say where node %s's sessions are: %s", node.id, exc)
            places = None
        places = places or {}
        # Not those moved on to another node.
        told = [s for s in lost if places.get(s) in (None, node.id)]
        claims = await self._claim([f"{node.id} lost {session_id}" for session_id in told])
        for session_id, webhooks in zip(told, claims, strict=True):
            self.observer.session_closed("lost", "node_lost")
            data = {"end_reason": "node_lost", "reason": "lost", "node": node.id}
            self.observer.event("session.closed", session_id, lost[session_id], data, webhooks)

    def _link_down(self, link: AgentLink, why: str) -> None:
        node = self.nodes.get(link.node_id)
        if node is not None and not self._stopped:
            log.error(
                "NODE DECLARED DEAD: node %s (%s:%d, agent pid %d, %s) is dead for good: %s; "
                "its %d sessions are told lost, its agent fences itself if it comes back. If "
                "its machine was only slow (starved of CPU), raise --node-deadline (%g s)",
                node.id, node.host, node.port, node.pid, node.state, why,
                len(node.residents), self.config.node_deadline_s,
            )  # fmt: skip
            self._set_state(node, DEAD, tell=True, why=why)

    def _link_stats(self, link: AgentLink, stats: dict[str, Any]) -> None:
        node = self.nodes.get(link.node_id)
        if node is not None and stats.get("seq", 0) > node.stats.get("seq", 0):
            node.stats = stats
            self._news.set()
            if stats.get("ended_seq", 0) > node.ended_seen and not node.collecting:
                node.collecting = True
                self._in_background(self._forget_ended(node))

    async def _forget_ended(self, node: Node) -> None:
        """Take the sessions that expired on a node out of the directory (it shrinks with
        them; those closed through a front end are taken out by it)."""
        try:
            assert node.link is not None
            ended = await node.link.call("ended_since", {"seq": node.ended_seen})
            if ended["ids"]:
                await self.engine.directory.forget_on.remote(ended["ids"], node.id)
                for session_id in ended["ids"]:
                    if self._where.get(session_id) == node.id:
                        del self._where[session_id]
            node.ended_seen = ended["seq"]
        finally:
            node.collecting = False

    async def wait_ready(self, profile: str = "lean", timeout_s: float = 120.0) -> None:
        """Wait until every live node's pool of the profile is full (as its agent reports)."""
        size = self.config.pool_size if profile == "lean" else self.config.data_pool_size
        async with asyncio.timeout(timeout_s):
            while any(n.stats.get("pool", {}).get(profile, 0) < size for n in self._alive()):
                self._news.clear()
                await self._news.wait()

    def _set_state(
        self,
        node: Node,
        state: str,
        *,
        tell: bool,
        why: str | None = None,
        turn: int | None = None,
    ) -> asyncio.Task[None]:
        """A node's new state, here at once; in the directory (tell: this front end's own
        verdict; else turn: the directory's, as learnt) and as an event (`_announce`), in
        the background (the task, for one who waits for it)."""
        changed = state != node.state and node.state != DEAD
        node.state = state
        if state == DEAD and node.link is not None:
            node.link.close(why="declared dead")
        return self._in_background(
            self._announce(node, state, why, changed=changed, tell=tell, turn=turn)
        )

    def _in_background(self, awaitable: Any) -> asyncio.Task[None]:
        async def run() -> None:
            try:
                await awaitable
            except Exception as exc:
                log.warning("cluster bookkeeping failed: %s", exc)

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _alive(self) -> builtins.list[Node]:
        return [n for n in self.nodes.values() if n.state == ALIVE and n.link is not None]

    async def node_metrics(self) -> dict[str, str]:
        """Each live node's Prometheus text, by node id (a node slow to answer is left out)."""
        nodes = self._alive()
        answers = await asyncio.gather(
            *(
                asyncio.wait_for(n.link.call("metrics"), METRICS_WAIT_S)
                for n in nodes
                if n.link is not None
            ),
            return_exceptions=True,
        )
        return {n.id: a for n, a in zip(nodes, answers, strict=True) if isinstance(a, str) and a}

    def cluster_view(self) -> dict[str, Any]:
        return {
            "ray_address": self.engine.address,
            "nodes": [node.view() for node in sorted(self.nodes.values(), key=lambda n: n.id)],
            "directory": self.directory_size,
        }

    @property
    def healthy(self) -> bool:
        return any(n.stats.get("healthy", True) for n in self._alive())

    def profiles(self) -> builtins.list[dict[str, Any]]:
        return self._profiles

    # -- stopping ----------------------------------------------------------------------------

    async def stop(self) -> None:
        """Leave the cluster. A local one (local:N) is ours: its agents pause their sessions
        and stop, then Ray's processes go too."""
        if self._stopped:
            return
        self._stopped = True
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        for node in self.nodes.values():
            if node.link is not None:
                node.link.close("the front end stopped")
        await asyncio.gather(
            *(n.relay for n in self.nodes.values() if n.relay is not None), return_exceptions=True
        )
        if self.engine.local:
            agents = [n for n in self.nodes.values() if n.state != DEAD and n.handle is not None]
            results = await asyncio.gather(
                *(asyncio.wait_for(n.handle.stop.remote(), AGENT_STOP_S) for n in agents),
                return_exceptions=True,
            )
            for node, result in zip(agents, results, strict=True):
                if isinstance(result, BaseException):
                    log.error("node agent %s did not stop cleanly: %s", node.id, result)
        await asyncio.gather(*self._background, return_exceptions=True)
        pids = [n.pid for n in self.nodes.values() if n.state != DEAD]
        if self._directory_pid is not None:
            pids.append(self._directory_pid)
        await asyncio.to_thread(self.engine.close, pids)
