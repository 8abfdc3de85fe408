"""Where each session of the cluster is: its node found for a request (the directory, or
the nodes asked), and sessions and snapshots moved off a draining node, their images
carried node to node by Ray's object store.

The second layer of `ClusterSessionManager` (`cluster/manager.py`), over `cluster/nodes.py`.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from typing import Any

from cloche.cluster.directory import ALIVE, DEAD, DRAINING
from cloche.cluster.link import LinkDown
from cloche.cluster.members import Node, node_failed
from cloche.cluster.nodes import ClusterNodes
from cloche.cluster.placement import choose
from cloche.errors import (
    NodeNotFound,
    SessionMoved,
    SessionNotFound,
    SnapshotNotFound,
    TooManySessions,
)
from cloche.sessions.kernel import EventCallback

log = logging.getLogger("cloche.cluster")


class SessionRouting(ClusterNodes):
    """The cluster's nodes, and which of them holds each session and snapshot."""

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

    async def _snapshot_node(self, snapshot_id: str) -> Node:
        node_id = await self.engine.directory.lookup_snapshot.remote(snapshot_id)
        node = self.nodes.get(node_id) if node_id is not None else None
        if node is None or node.state == DEAD or node.link is None:
            raise SnapshotNotFound(snapshot_id)
        return node

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
        await self._set_state(node, DRAINING, tell=True)  # the others stop placing there too
        session_ids, snapshot_ids = await node.handle.held.remote()
        self._heard(node)
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

    def _heard(self, node: Node) -> None:
        """A node's agent answered over Ray (a drain's call): alive, however late its
        heartbeats are on a starved machine."""
        if node.link is not None:
            node.link.heard()

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
        await self._set_state(node, ALIVE, tell=True)
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
            await target.handle.adopt_session.remote(raw, image)  # once source exported it
        except BaseException:
            await source.handle.release_session.remote(session_id, False)
            raise
        self._heard(source)
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
