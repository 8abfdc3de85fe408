"""The cluster's `SessionManager`: sessions held by node agents on the machines of a Ray
cluster, reached from any front end.

A front end holds no session. It places a new one on the node with the most headroom
(`cluster/placement.py`), records where it went in the directory, and sends each request
for it to that node's agent over the data path. A node whose agent stops answering is dead
for good: its sessions say they were lost (and are told closed, `node_lost`), the others go
on. A drain moves a node's sessions (paused, their images carried by Ray's object store) to
other nodes. Each node's session events reach this front end's observer through
`cluster/relay.py`.

Its layers: the nodes (`cluster/nodes.py`), where each session is (`cluster/routing.py`),
the process verbs (`cluster/commands.py`), and here the other verbs of `SessionManager`,
each sent to the node that holds the session.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, Mapping, Sequence
from typing import Any

from cloche.cluster import codec
from cloche.cluster.commands import ClusterCommands
from cloche.cluster.directory import ALIVE
from cloche.cluster.link import LinkDown
from cloche.cluster.members import Node, node_failed
from cloche.cluster.placement import choose
from cloche.errors import (
    ClocheError,
    EgressRefused,
    NotSupported,
    SandboxStartError,
    SnapshotNotFound,
    TooManySessions,
)
from cloche.sandbox.listing import FileListing
from cloche.sessions.history import CellEntry
from cloche.sessions.kernel import EventCallback
from cloche.sessions.manager import EgressAsk, InstalledPackages, check_metadata
from cloche.sessions.result import CellResult
from cloche.sessions.session import SessionInfo
from cloche.sessions.store import SnapshotRecord
from cloche.sessions.volumes import NOT_HERE as VOLUMES_NOT_HERE

STREAM_CHUNK_BYTES = 1 << 20


class ClusterSessionManager(ClusterCommands):
    """Sessions on the node agents of a Ray cluster (`cloche serve --cluster ...`)."""

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
        volumes: Sequence[Mapping[str, Any]] | None = None,
    ) -> SessionInfo:
        if volumes:
            raise NotSupported(VOLUMES_NOT_HERE)
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


def _b64(data: bytearray) -> str:
    return codec.bytes_out(bytes(data))
