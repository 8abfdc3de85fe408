"""The cluster's `SessionManager`: sessions held by node agents on the machines of a Ray
cluster, reached from any front end.

A front end holds no session. It places a new one on the node with the most headroom
(`cluster/placement.py`), records where it went in the directory, and sends each request
for it to that node's agent over the data path. A node whose agent stops answering is dead
for good: its sessions say they were lost (and are told closed, `node_lost`), the others go
on. A drain moves a node's sessions (paused, their images carried by Ray's object store) to
other nodes. Each node's session events reach this front end's observer through
`cluster/relay.py`.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import logging
import ssl
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cloche.cluster import codec
from cloche.cluster.agent import NodeFigures
from cloche.cluster.directory import ALIVE, DEAD, DRAINING
from cloche.cluster.engine import Engine, RayNode
from cloche.cluster.link import AgentLink, LinkDown
from cloche.cluster.placement import choose
from cloche.cluster.relay import EventSink, relay
from cloche.cluster.tls import front_end_context
from cloche.config import ServerConfig
from cloche.errors import (
    ClocheError,
    ConfigError,
    EgressRefused,
    NodeNotFound,
    SandboxStartError,
    SessionLost,
    SessionMoved,
    SessionNotFound,
    SnapshotNotFound,
    TooManySessions,
)
from cloche.sandbox.files import FileListing
from cloche.sessions.history import CellEntry
from cloche.sessions.kernel import EventCallback
from cloche.sessions.manager import (
    EgressAsk,
    InstalledPackages,
    SessionManager,
    check_metadata,
)
from cloche.sessions.observer import Observer
from cloche.sessions.result import CellResult
from cloche.sessions.session import SessionInfo
from cloche.sessions.store import SnapshotRecord

log = logging.getLogger("cloche.cluster")

WATCH_S = 2.0  # how often the front end looks for new nodes and others' verdicts
AGENT_START_S = 300.0  # a node agent's start (its pools fill first)
AGENT_STOP_S = 120.0  # a node agent pausing its sessions at the cluster's stop
STREAM_CHUNK_BYTES = 1 << 20
METRICS_WAIT_S = 2.0  # a node slower than this to give its figures is left out of a scrape
LOST_WAIT_S = 5.0  # a dead node's last events, then the directory, before its losses are told


def node_failed(session_id: str) -> SessionLost:
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


class ClusterSessionManager(SessionManager):
    """Sessions on the node agents of a Ray cluster (`cloche serve --cluster ...`)."""

    def __init__(
        self,
        config: ServerConfig,
        observer: Observer | None = None,
        node_figures: Callable[[EventSink], NodeFigures] | None = None,
    ) -> None:
        """observer: told of this front end's events (the server's metrics); node_figures:
        makes what each node agent reports to (the same kind of metrics, per node)."""
        self.config = config
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
        # A machine whose agent was declared dead gets a new agent only once that one has
        # fenced itself (removed all it held, and gone): until then it may hold sandboxes.
        held_back = {n["ray_id"] for n in known if n["state"] == DEAD and not n.get("fenced")}
        for entry in known:
            node = self.nodes.get(entry["id"])
            if node is not None and entry["state"] != node.state and node.state != DEAD:
                self._set_state(node, entry["state"], tell=False)
        linked = {n.ray_id for n in self.nodes.values() if n.state != DEAD}
        fresh = [
            ray_node
            for ray_node in await asyncio.to_thread(self.engine.nodes)
            if ray_node.ray_id not in linked and ray_node.ray_id not in held_back
        ]
        await asyncio.gather(*(self._join(ray_node) for ray_node in fresh))
        for entry in known:  # dead nodes others saw, for GET /v1/cluster
            if entry["id"] not in self.nodes and entry["state"] == DEAD:
                self.nodes[entry["id"]] = Node(
                    entry["id"], entry["ray_id"], entry["host"], entry["port"], entry["pid"],
                    None, None, DEAD,
                )  # fmt: skip

    async def _join(self, ray_node: RayNode) -> None:
        handle = await asyncio.to_thread(
            self.engine.agent, ray_node, self._secret, self._egress_ca, self._data_ca
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
        told = functools.partial(self._relayed, node)
        node.relay = asyncio.create_task(
            relay(link, link.greeting.get("events", 0), told), name=f"events-{node.id}"
        )
        self.nodes[node.id] = node
        self.observer.event("node.up", None, None, node.event_data(ALIVE))
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
    ) -> None:
        """An event of a node's sessions, told on as this front end's own, with the node."""
        if session_id is not None and kind.startswith("session."):
            if kind == "session.closed":
                node.residents.pop(session_id, None)
            else:
                node.residents[session_id] = owner_key
        self.observer.event(kind, session_id, owner_key, {**data, "node": node.id})

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
        for session_id, owner_key in lost.items():
            if places.get(session_id) not in (None, node.id):
                continue  # moved on to another node
            self.observer.session_closed("lost", "node_lost")
            data = {"end_reason": "node_lost", "reason": "lost", "node": node.id}
            self.observer.event("session.closed", session_id, owner_key, data)

    def _link_down(self, link: AgentLink, why: str) -> None:
        node = self.nodes.get(link.node_id)
        if node is not None and not self._stopped:
            log.error("node %s is dead (%s): its sessions are lost", node.id, why)
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

    def _set_state(self, node: Node, state: str, *, tell: bool, why: str | None = None) -> None:
        if state != node.state:  # told as an event (GET /v1/events, webhooks)
            kind = {ALIVE: "node.up", DRAINING: "node.draining", DEAD: "node.dead"}[state]
            self.observer.event(kind, None, None, node.event_data(state, why))
        if state == DEAD and node.state != DEAD:
            self._in_background(self._tell_lost(node))
        node.state = state
        if state == DEAD and node.link is not None:
            node.link.close(why="declared dead")
        if tell:
            self._in_background(self.engine.directory.set_state.remote(node.id, state))

    def _in_background(self, awaitable: Any) -> None:
        async def run() -> None:
            try:
                await awaitable
            except Exception as exc:
                log.warning("cluster bookkeeping failed: %s", exc)

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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

    # -- finding a session's node ----------------------------------------------------------

    async def _node_of(self, session_id: str) -> Node:
        node_id = self._where.get(session_id)
        if node_id is None:
            node_id = await self.engine.directory.lookup.remote(session_id)
            if node_id is None:
                node_id = await self._ask_nodes(session_id)
            self._where[session_id] = node_id
        node = self.nodes.get(node_id)
        if node is None:  # a node this front end has not met yet
            await self._discover()
            node = self.nodes.get(node_id)
        if node is None or node.state == DEAD or node.link is None:
            raise node_failed(session_id)
        return node

    async def _ask_nodes(self, session_id: str) -> str:
        """The node that holds a session the directory does not know yet (its placement is
        on its way). Raises SessionNotFound."""
        nodes = self._alive()
        answers = await asyncio.gather(
            *(n.link.call("holds", {"session_id": session_id}) for n in nodes if n.link),
            return_exceptions=True,
        )
        for node, answer in zip(nodes, answers, strict=True):
            if answer is True:
                return node.id
        raise SessionNotFound(session_id)

    async def _call(
        self,
        session_id: str,
        op: str,
        args: dict[str, Any],
        on_event: EventCallback | None = None,
    ) -> Any:
        """A request about a session, sent to the node that holds it."""
        for _ in range(4):
            node = await self._node_of(session_id)
            assert node.link is not None
            try:
                return await node.link.call(op, {"session_id": session_id, **args}, on_event)
            except LinkDown:
                raise node_failed(session_id) from None
            except SessionMoved:
                self._where.pop(session_id, None)  # drained: the directory knows where
        raise SessionNotFound(session_id)

    # -- sessions --------------------------------------------------------------------------

    async def create(
        self,
        owner: str | None = None,
        profile: str = "lean",
        snapshot: str | None = None,
        egress: EgressAsk = None,
        metadata: Mapping[str, str] | None = None,
        cell_timeout_s: float | None = None,
        template: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> SessionInfo:
        labels = check_metadata(metadata) if metadata else None
        if egress is not None and self.config.egress_policy is None:
            raise EgressRefused(
                "this server gives sessions no egress (start it with --egress-policy)"
            )
        pinned: Node | None = None
        if snapshot is not None:
            pinned = await self._snapshot_node(snapshot)
            if pinned.state != ALIVE:  # draining: the copy goes where new sessions go
                target = choose(self._alive(), profile)
                if target is None:
                    raise TooManySessions("no live node of the cluster has room")
                await self._copy_snapshot(pinned, target, snapshot)
                pinned = target
        for _ in range(3):
            node = pinned or choose(self._alive(), profile)
            if node is None:
                raise TooManySessions(
                    "every node of the cluster is at --max-sessions, draining or dead"
                )
            assert node.link is not None
            node.inflight += 1
            try:
                reply = await node.link.call(
                    "create",
                    {
                        "owner": owner,
                        "profile": profile,
                        "snapshot": snapshot,
                        "egress": egress,
                        "metadata": labels,
                        "cell_timeout_s": cell_timeout_s,
                        "template": template,
                        "env": dict(env) if env else None,
                    },
                )
            except LinkDown:
                if pinned is not None:
                    raise SnapshotNotFound(snapshot or "") from None
                continue  # that node just died: another one
            finally:
                node.inflight -= 1
            self._link_stats(node.link, reply["stats"])
            self.created += 1
            info = codec.info_in(reply["info"])
            self._where[info.id] = node.id
            node.residents[info.id] = info.owner_key
            # Not waited for: a front end that asks before it lands asks the nodes instead.
            self._in_background(self.engine.directory.place.remote([info.id], node.id))
            return info
        raise SandboxStartError("no node of the cluster could start a session")

    async def info(self, session_id: str, owner: str | None = None) -> SessionInfo:
        return codec.info_in(await self._call(session_id, "info", {"owner": owner}))

    async def sessions(
        self,
        owner: str | None = None,
        *,
        every: bool = False,
        state: str | None = None,
        profile: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> builtins.list[SessionInfo]:
        found: builtins.list[SessionInfo] = []
        asked = {
            "owner": owner,
            "every": every,
            "state": state,
            "profile": profile,
            "metadata": dict(metadata) if metadata else None,
        }
        for listing in await self._everywhere("sessions", asked):
            found += [codec.info_in(raw) for raw in listing]
        return sorted(found, key=lambda info: info.created_at)

    async def set_metadata(
        self, session_id: str, changes: Mapping[str, str | None], owner: str | None = None
    ) -> SessionInfo:
        args = {"owner": owner, "changes": dict(changes)}
        return codec.info_in(await self._call(session_id, "set_metadata", args))

    async def history(
        self,
        session_id: str,
        owner: str | None = None,
        *,
        after: int = 0,
        limit: int | None = None,
    ) -> builtins.list[CellEntry]:
        args = {"owner": owner, "after": after, "limit": limit}
        return [CellEntry(**raw) for raw in await self._call(session_id, "history", args)]

    async def cell(self, session_id: str, number: int, owner: str | None = None) -> CellEntry:
        args = {"owner": owner, "number": number}
        return CellEntry(**await self._call(session_id, "cell", args))

    async def _everywhere(self, op: str, args: dict[str, Any]) -> builtins.list[Any]:
        """One request to every live node; the answers of those that gave one."""
        nodes = [n for n in self.nodes.values() if n.state != DEAD and n.link is not None]
        answers = await asyncio.gather(
            *(n.link.call(op, args) for n in nodes if n.link is not None), return_exceptions=True
        )
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, LinkDown):
                raise answer
        return [a for a in answers if not isinstance(a, BaseException)]

    async def execute(
        self,
        session_id: str,
        code: str,
        *,
        owner: str | None = None,
        timeout_s: float | None = None,
        on_event: EventCallback | None = None,
        track_files: bool = False,
        silent: bool = False,
        stdin: bool = False,
        pager: bool = False,
        front_end: str = "",
        accepted: asyncio.Event | None = None,
    ) -> CellResult:
        events = on_event
        if accepted is not None:  # the node says so as an event of its own, not passed on

            def events(event: dict[str, Any]) -> None:
                if event.get("type") == codec.ACCEPTED:
                    accepted.set()
                elif on_event is not None:
                    on_event(event)

        raw = await self._call(
            session_id,
            "execute",
            {
                "code": code,
                "owner": owner,
                "timeout_s": timeout_s,
                "track_files": track_files,
                "silent": silent,
                "stdin": stdin,
                "pager": pager,
                "front_end": front_end,
                "stream": on_event is not None,
                "accepted": accepted is not None,
            },
            events,
        )
        return codec.result_in(raw)  # counted by its node (/metrics labels it `node`)

    async def interrupt(self, session_id: str, owner: str | None = None) -> bool:
        interrupted: bool = await self._call(session_id, "interrupt", {"owner": owner})
        return interrupted

    async def restart(self, session_id: str, owner: str | None = None) -> SessionInfo:
        return codec.info_in(await self._call(session_id, "restart", {"owner": owner}))

    async def answer_input(self, session_id: str, value: str, owner: str | None = None) -> bool:
        answered: bool = await self._call(
            session_id, "answer_input", {"owner": owner, "value": value}
        )
        return answered

    async def close(
        self, session_id: str, owner: str | None = None, reason: str = "closed"
    ) -> None:
        await self._call(session_id, "close", {"owner": owner, "reason": reason})
        node = self.nodes.get(self._where.pop(session_id, ""))
        if node is not None:  # closed: not lost if its node dies before the event comes
            node.residents.pop(session_id, None)
        self._in_background(self.engine.directory.forget.remote(session_id))

    async def install_packages(
        self, session_id: str, specs: Sequence[str], owner: str | None = None
    ) -> InstalledPackages:
        installed: InstalledPackages = await self._call(
            session_id, "install_packages", {"specs": list(specs), "owner": owner}
        )
        return installed

    # -- files -----------------------------------------------------------------------------

    async def list_files(self, session_id: str, owner: str | None = None) -> FileListing:
        return codec.listing_in(await self._call(session_id, "list_files", {"owner": owner}))

    async def read_file(self, session_id: str, path: str, owner: str | None = None) -> bytes:
        raw = await self._call(session_id, "read_file", {"path": path, "owner": owner})
        return codec.bytes_in(raw)

    async def read_stream(
        self, session_id: str, path: str, owner: str | None = None
    ) -> tuple[int, AsyncGenerator[bytes, None]]:
        opened = await self._call(session_id, "read_open", {"path": path, "owner": owner})
        node = await self._node_of(session_id)
        assert node.link is not None
        link, handle = node.link, opened["handle"]

        async def pieces() -> AsyncGenerator[bytes, None]:
            finished = False
            try:
                while piece := codec.bytes_in(await link.call("read_piece", {"handle": handle})):
                    yield piece
                finished = True
            except LinkDown:
                raise node_failed(session_id) from None
            finally:
                if not finished:  # given up before the end: the node closes it now
                    with contextlib.suppress(ClocheError, LinkDown):
                        await link.call("read_close", {"handle": handle})

        return int(opened["size"]), pieces()

    async def write_files(
        self, session_id: str, files: Sequence[tuple[str, bytes]], owner: str | None = None
    ) -> None:
        if not files:
            await self.info(session_id, owner)
            return
        encoded = [[path, codec.bytes_out(data)] for path, data in files]
        await self._call(session_id, "write_files", {"files": encoded, "owner": owner})

    async def write_stream(
        self,
        session_id: str,
        path: str,
        chunks: AsyncIterable[bytes],
        owner: str | None = None,
    ) -> int:
        node = await self._node_of(session_id)
        assert node.link is not None
        link = node.link
        try:
            handle = await link.call(
                "stream_open", {"session_id": session_id, "path": path, "owner": owner}
            )
        except LinkDown:
            raise node_failed(session_id) from None
        committed = False
        try:
            buffer = bytearray()
            async for chunk in chunks:
                buffer += chunk
                if len(buffer) >= STREAM_CHUNK_BYTES:
                    await link.call("stream_chunk", {"handle": handle, "data": _b64(buffer)})
                    buffer.clear()
            if buffer:
                await link.call("stream_chunk", {"handle": handle, "data": _b64(buffer)})
            size: int = await link.call("stream_end", {"handle": handle, "commit": True})
            committed = True
            return size
        except LinkDown:
            raise node_failed(session_id) from None
        finally:
            if not committed:
                with contextlib.suppress(ClocheError):
                    await link.call("stream_end", {"handle": handle, "commit": False})

    # -- durability --------------------------------------------------------------------------

    async def snapshot(
        self, session_id: str, owner: str | None = None, name: str = ""
    ) -> SnapshotRecord:
        raw = await self._call(session_id, "snapshot", {"owner": owner, "name": name})
        record = codec.snapshot_in(raw)
        node_id = self._where[session_id]
        await self.engine.directory.place_snapshot.remote(record.id, node_id)
        return record

    async def snapshots(self, owner: str | None = None) -> builtins.list[SnapshotRecord]:
        found: dict[str, SnapshotRecord] = {}
        for listing in await self._everywhere("snapshots", {"owner": owner}):
            for raw in listing:
                record = codec.snapshot_in(raw)
                found[record.id] = record  # a drained node may still hold a copy
        return sorted(found.values(), key=lambda record: record.created_at)

    async def _snapshot_node(self, snapshot_id: str) -> Node:
        node_id = await self.engine.directory.lookup_snapshot.remote(snapshot_id)
        node = self.nodes.get(node_id) if node_id is not None else None
        if node is None or node.state == DEAD or node.link is None:
            raise SnapshotNotFound(snapshot_id)
        return node

    async def get_snapshot(self, snapshot_id: str, owner: str | None = None) -> SnapshotRecord:
        node = await self._snapshot_node(snapshot_id)
        assert node.link is not None
        raw = await node.link.call("get_snapshot", {"snapshot_id": snapshot_id, "owner": owner})
        return codec.snapshot_in(raw)

    async def delete_snapshot(self, snapshot_id: str, owner: str | None = None) -> None:
        node = await self._snapshot_node(snapshot_id)
        assert node.link is not None
        await node.link.call("delete_snapshot", {"snapshot_id": snapshot_id, "owner": owner})
        self._in_background(self.engine.directory.forget_snapshot.remote(snapshot_id))

    async def fork(
        self, session_id: str, count: int = 1, owner: str | None = None
    ) -> builtins.list[SessionInfo]:
        reply = await self._call(session_id, "fork", {"count": count, "owner": owner})
        copies = [codec.info_in(raw) for raw in reply["copies"]]
        node_id = self._where[session_id]
        for copy in copies:
            self._where[copy.id] = node_id
            if (node := self.nodes.get(node_id)) is not None:
                node.residents[copy.id] = copy.owner_key
        await self.engine.directory.place.remote([c.id for c in copies], node_id)
        return copies

    async def pause(self, session_id: str, owner: str | None = None) -> SessionInfo:
        return codec.info_in(await self._call(session_id, "pause", {"owner": owner}))

    async def resume(self, session_id: str, owner: str | None = None) -> SessionInfo:
        return codec.info_in(await self._call(session_id, "resume", {"owner": owner}))

    # -- drain -------------------------------------------------------------------------------

    async def drain(self, node_id: str, grace_s: float | None = None) -> dict[str, Any]:
        """Move every session and snapshot of a node to the others; it takes no new ones.
        node_id may be the node's address instead (a pod's preStop knows its IP). Moves
        stop after grace_s (default --node-grace): what was not moved by then is reported
        failed, with why.

        Raises:
            NodeNotFound: no live node of that id (or address, or more than one there).
        """
        node = self._node_named(node_id)
        grace = self.config.node_grace_s if grace_s is None else grace_s
        deadline = asyncio.get_running_loop().time() + grace
        self._set_state(node, DRAINING, tell=False)
        await self.engine.directory.set_state.remote(node.id, DRAINING)  # others stop too
        session_ids, snapshot_ids = await node.handle.held.remote()
        moved, failed, why = 0, [], {}
        for session_id in session_ids:
            if asyncio.get_running_loop().time() >= deadline:
                failed.append(session_id)
                why[session_id] = f"not moved within the drain's grace of {grace:g} s"
                continue
            try:
                await self._move(node, session_id)
                moved += 1
            except Exception as exc:
                log.error("session %s not moved off node %s: %s", session_id, node.id, exc)
                failed.append(session_id)
                why[session_id] = str(exc) or type(exc).__name__
        copied = 0
        for snapshot_id in snapshot_ids:
            target = choose(self._alive(), "lean")
            if target is None or asyncio.get_running_loop().time() >= deadline:
                break
            try:
                await self._copy_snapshot(node, target, snapshot_id)
            except Exception as exc:  # deleted meanwhile, or no room there: it stays
                log.error("snapshot %s not copied off node %s: %s", snapshot_id, node.id, exc)
                continue
            copied += 1
        log.info("node %s drained: %d sessions moved, %d failed", node.id, moved, len(failed))
        return {
            "node": node.id,
            "moved": moved,
            "failed": failed,
            "why": why,
            "snapshots": copied,
            "snapshots_left": len(snapshot_ids) - copied,
        }

    def _node_named(self, name: str) -> Node:
        """The live node of an id, or the one live node at an address."""
        node = self.nodes.get(name)
        if node is None:
            there = [n for n in self.nodes.values() if n.host == name and n.state != DEAD]
            if len(there) > 1:
                raise NodeNotFound(
                    f"{len(there)} nodes are at {name}: name one by its id (GET /v1/cluster)"
                )
            node = there[0] if there else None
        if node is None or node.state == DEAD:
            raise NodeNotFound(f"Node {name} not found, or dead")
        return node

    async def undrain(self, node_id: str) -> dict[str, Any]:
        """Return a draining node to service: new sessions may go to it again.

        Raises:
            NodeNotFound: no draining or live node of that id (a dead one stays dead).
        """
        node = self.nodes.get(node_id)
        if node is None or node.state == DEAD:
            raise NodeNotFound(f"Node {node_id} not found, or dead")
        self._set_state(node, ALIVE, tell=False)
        await self.engine.directory.set_state.remote(node.id, ALIVE)
        log.info("node %s back in service", node.id)
        return {"node": node.id, "state": ALIVE}

    async def _copy_snapshot(self, source: Node, target: Node, snapshot_id: str) -> None:
        """A snapshot's image copied to another node (node to node, through Ray's object
        store), which the directory then names for it."""
        raw, image = source.handle.export_snapshot.options(num_returns=2).remote(snapshot_id)
        await target.handle.adopt_snapshot.remote(raw, image)
        await self.engine.directory.place_snapshot.remote(snapshot_id, target.id)

    async def _move(self, source: Node, session_id: str) -> None:
        """Pause a session on source and resume it, same id and state, on another node: its
        image goes from node to node through Ray's object store."""
        target = choose(self._alive(), "lean")
        if target is None:
            raise TooManySessions("no other node has room")
        raw, image = source.handle.export_session.options(num_returns=2).remote(session_id)
        try:
            await target.handle.adopt_session.remote(raw, image)
        except BaseException:
            await source.handle.release_session.remote(session_id, False)
            raise
        await self.engine.directory.place.remote([session_id], target.id)
        self._where[session_id] = target.id
        if session_id in source.residents:
            target.residents[session_id] = source.residents.pop(session_id)
        try:  # moved: what the source does with its copy no longer changes that
            await source.handle.release_session.remote(session_id, True)
        except Exception as exc:  # the source went away meanwhile: nothing to release
            log.warning(
                "session %s moved; node %s did not release it: %s", session_id, source.id, exc
            )

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


def _b64(data: bytearray) -> str:
    return codec.bytes_out(bytes(data))
