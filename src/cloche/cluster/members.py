"""The cluster's nodes as members, as one front end holds them: each a `Node`, and its changes
of state (alive, draining, dead for good) with what this front end tells of them: `node.up`,
`node.draining`, `node.dead`, each of the node's sessions told closed (`node_lost`) when it
dies, and the events of its sessions relayed from its agent (`cluster/relay.py`).

Every front end tells them all on its own stream; each webhook receiver gets each once, from
the front end that claimed it in the directory (named alike on every front end: by the
node's turn, or its death), as it gets each event of a node's sessions once (the relay).

The lowest layer of `ClusterSessionManager` (`cluster/manager.py`): joining and watching the
nodes is the next (`cluster/nodes.py`).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from dataclasses import dataclass, field
from typing import Any

from cloche.cluster.directory import ALIVE, DEAD, DRAINING
from cloche.cluster.engine import Engine
from cloche.cluster.link import AgentLink
from cloche.config import ServerConfig
from cloche.errors import SessionLost
from cloche.sessions.manager import SessionManager
from cloche.sessions.observer import Observer

log = logging.getLogger("cloche.cluster")

LOST_WAIT_S = 5.0  # a dead node's last events, then the directory, before its losses are told
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


class Members(SessionManager):
    """A cluster's nodes, their changes of state, and what this front end tells of them."""

    config: ServerConfig
    observer: Observer
    engine: Engine
    nodes: dict[str, Node]
    webhooks: frozenset[str]  # its webhook receivers' ids, whose deliveries it claims
    _background: set[asyncio.Task[Any]]
    _stopped: bool

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
