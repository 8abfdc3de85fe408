"""The session directory: which node holds each session and snapshot, and which nodes there
are, kept in the cluster so that every front end agrees.

It runs as a detached, named Ray actor on the head node (`cluster/engine.py`); its methods
are called one at a time, so it needs no locks. Front ends cache what they learn and ask
again when an agent says a session moved. A node, once dead, stays dead here: a new agent
on the same machine joins under a new id, and sessions of the old one stay lost. A dead
node's agent that comes back (it was frozen, or cut off) learns its verdict here, removes
all it held and says so (`fenced`); only then may its machine have a new agent.

Each change of a node's state is numbered (its `turn`), so that the front ends, each of
which tells it as an event, can claim its delivery to each webhook receiver here, once
(`claim`).
"""

from __future__ import annotations

import os
import secrets
from typing import Any

ALIVE, DRAINING, DEAD = "alive", "draining", "dead"


class Directory:
    """Session id -> node id; snapshot id -> node id; node id -> where and how it is."""

    def __init__(self) -> None:
        self.secret = secrets.token_hex(32)  # what front ends show node agents
        self.nodes: dict[str, dict[str, Any]] = {}
        self.sessions: dict[str, str] = {}
        self.snapshots: dict[str, str] = {}
        self.egress_ca: tuple[bytes, bytes] | None = None
        self.data_ca: tuple[bytes, bytes] | None = None
        # Of each event told by the front ends (a node's change, a session lost with its
        # node), the webhook receivers a front end has claimed its delivery to.
        self.claimed: dict[str, set[str]] = {}

    def cluster_secret(self) -> str:
        return self.secret

    def interception_ca(self) -> tuple[bytes, bytes]:
        """The CA every node's egress proxy intercepts secret-carrying hosts with (one for
        the cluster: a session that moves keeps trusting it), made when first asked for."""
        if self.egress_ca is None:
            from cloche.network.egress.tls import make_ca

            self.egress_ca = make_ca()
        return self.egress_ca

    def data_path_ca(self) -> tuple[bytes, bytes]:
        """The CA of the data path's mutual TLS (`cluster/tls.py`): front ends hold it and
        issue certificates with it; made when first asked for."""
        if self.data_ca is None:
            from cloche.cluster.tls import make_ca

            self.data_ca = make_ca()
        return self.data_ca

    def pid(self) -> int:
        """Its process (waited for when a local cluster stops)."""
        return os.getpid()

    def join(self, node: dict[str, Any]) -> str:
        """A node agent, as it describes itself ({"id", "host", "port", "pid", ...}); its
        state here (dead: a front end must not link to it)."""
        known = self.nodes.get(node["id"]) or {}
        state: str = known.get("state", ALIVE)
        self.nodes[node["id"]] = {**known, **node, "state": state, "turn": known.get("turn", 0)}
        return state

    def node_state(self, node_id: str) -> str | None:
        """A node's state (None: it has not joined): what its agent asks, to learn whether
        it was declared dead."""
        node = self.nodes.get(node_id)
        return node["state"] if node is not None else None

    def fenced(self, node_id: str) -> None:
        """A dead node's agent removed every sandbox, paused image and snapshot it held and
        is going: its machine (Ray node) may have a new agent, under a new id."""
        node = self.nodes.get(node_id)
        if node is not None and node["state"] == DEAD:
            node["fenced"] = True

    def ended(self, node_id: str) -> None:
        """A dead node's agent ended without fencing itself (killed -9): its machine may
        have a new agent, which deletes what it left (`NodeAgent`'s predecessor)."""
        node = self.nodes.get(node_id)
        if node is not None and node["state"] == DEAD:
            node["ended"] = True

    def all_nodes(self) -> list[dict[str, Any]]:
        return list(self.nodes.values())

    def set_state(self, node_id: str, state: str) -> int | None:
        """Mark a node draining or dead (dead is for good), or alive again after a drain;
        the turn of its state now (None: no such node)."""
        node = self.nodes.get(node_id)
        if node is None:
            return None
        if node["state"] != DEAD and node["state"] != state:
            node["state"] = state
            node["turn"] = node.get("turn", 0) + 1
        turn: int = node.get("turn", 0)
        return turn

    def claim(self, events: list[str], receivers: list[str]) -> list[list[str]]:
        """For each event (named alike by every front end that tells it), the receivers of
        those given that no front end has claimed it for before: the caller's to deliver."""
        answers = []
        for event in events:
            claimed = self.claimed.setdefault(event, set())
            answers.append([r for r in receivers if r not in claimed])
            claimed.update(receivers)
        return answers

    def place(self, session_ids: list[str], node_id: str) -> None:
        for session_id in session_ids:
            self.sessions[session_id] = node_id

    def lookup(self, session_id: str) -> str | None:
        return self.sessions.get(session_id)

    def nodes_of(self, session_ids: list[str]) -> dict[str, str | None]:
        """Where each session is (None: not placed, or forgotten)."""
        return {session_id: self.sessions.get(session_id) for session_id in session_ids}

    def forget(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def forget_on(self, session_ids: list[str], node_id: str) -> int:
        """Forget sessions that ended on a node (expired there), unless one has moved on to
        another node meanwhile; how many were forgotten."""
        gone = [s for s in session_ids if self.sessions.get(s) == node_id]
        for session_id in gone:
            del self.sessions[session_id]
        return len(gone)

    def size(self) -> dict[str, int]:
        """What it holds: sessions and snapshots it can place (a metric of the front ends)."""
        return {"sessions": len(self.sessions), "snapshots": len(self.snapshots)}

    def place_snapshot(self, snapshot_id: str, node_id: str) -> None:
        self.snapshots[snapshot_id] = node_id

    def lookup_snapshot(self, snapshot_id: str) -> str | None:
        return self.snapshots.get(snapshot_id)

    def forget_snapshot(self, snapshot_id: str) -> None:
        self.snapshots.pop(snapshot_id, None)
