"""The cluster's nodes as one front end holds them: each node agent (`Node`) started or
found, linked over the data path, its events relayed (`cluster/relay.py`), watched, and
declared dead for good when its link goes down (its sessions then say they were lost, and
are told closed, `node_lost`: `cluster/members.py`). A machine whose agent was declared dead
gets a new one once the old one is gone (it fenced itself, or Ray says it died).

A layer of `ClusterSessionManager` (`cluster/manager.py`), over `cluster/members.py`; where
each session is, and moving sessions off a draining node, is the next layer's
(`cluster/routing.py`).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import logging
import ssl
from collections.abc import Callable
from typing import Any

from cloche.cluster.agent import NodeFigures
from cloche.cluster.directory import ALIVE, DEAD
from cloche.cluster.engine import Engine, RayNode
from cloche.cluster.link import AgentLink, LinkDown
from cloche.cluster.members import Members, Node
from cloche.cluster.relay import relay
from cloche.cluster.tls import front_end_context
from cloche.config import ServerConfig
from cloche.errors import ClocheError, ConfigError
from cloche.sessions.observer import EventSink, Observer

log = logging.getLogger("cloche.cluster")

WATCH_S = 2.0  # how often the front end looks for new nodes and others' verdicts
AGENT_START_S = 300.0  # a node agent's start (its pools fill first)
AGENT_STOP_S = 120.0  # a node agent pausing its sessions at the cluster's stop
METRICS_WAIT_S = 2.0  # a node slower than this to give its figures is left out of a scrape
ENDED_ASK_S = 1.0  # Ray, whether a dead node's agent ended (a frozen one does not answer)


class ClusterNodes(Members):
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
