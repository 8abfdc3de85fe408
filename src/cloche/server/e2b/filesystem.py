"""envd's `filesystem.Filesystem` service over the sandbox's files, as the request's user.

Stat, ListDir, MakeDir, Move and Remove are the manager's file verbs (`fs_*`, done inside
the sandbox as the user). Watching is a bounded poll: the directory is listed every
WATCH_PERIOD_S (to WATCH_DEPTH levels when recursive) and the differences are told as
create, write, chmod and remove events; a watcher (CreateWatcher) keeps its last listing
and tells what changed since, each time it is asked. A file made and removed between two
looks is not seen.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_connect
from e2b.envd.filesystem import filesystem_pb as pb
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from cloche.server.e2b.process import one
from cloche.server.e2b.routing import Reach, Where, call
from cloche.sessions.filesystem import Entry

WATCH_PERIOD_S = 0.5
WATCH_DEPTH = 16
MAX_WATCHERS = 64  # per server: a watcher nobody asks about is dropped first
_TYPES = {"file": pb.FileType.FILE, "dir": pb.FileType.DIRECTORY}
Listing = dict[str, Entry]


def entry_info(entry: Entry) -> pb.EntryInfo:
    """An entry as envd tells it (a symlink: its target's type, `is_symlink`)."""
    return pb.EntryInfo(
        name=entry.name,
        type=_TYPES.get(entry.type, pb.FileType.UNSPECIFIED),
        path=entry.path,
        size=entry.size,
        mode=entry.mode,
        permissions=entry.permissions,
        owner=entry.owner,
        group=entry.group,
        modified_time=Timestamp(
            seconds=entry.modified_ns // 1_000_000_000, nanos=entry.modified_ns % 1_000_000_000
        ),
        symlink_target=entry.symlink_target,
        is_symlink=entry.symlink_target is not None,
    )


async def _look(where: Where, path: str, recursive: bool) -> Listing:
    entries = await call(
        where.manager.fs_list(
            where.id, path, WATCH_DEPTH if recursive else 1, user=where.user, owner=where.owner
        )
    )
    return {entry.path: entry for entry in entries}


def _changes(
    top: str, before: Listing, after: Listing, with_entry: bool
) -> list[pb.FilesystemEvent]:
    events = []

    def event(kind: pb.EventType, entry: Entry) -> None:
        name = os.path.relpath(entry.path, top)
        info = entry_info(entry) if with_entry and kind != pb.EventType.REMOVE else None
        events.append(pb.FilesystemEvent(name=name, type=kind, entry=info))

    for path, entry in after.items():
        old = before.get(path)
        if old is None:
            event(pb.EventType.CREATE, entry)
        elif (old.size, old.modified_ns) != (entry.size, entry.modified_ns):
            event(pb.EventType.WRITE, entry)
        elif old.mode != entry.mode:
            event(pb.EventType.CHMOD, entry)
    for path, entry in before.items():
        if path not in after:
            event(pb.EventType.REMOVE, entry)
    return events


class _Watcher:
    def __init__(self, where: Where, path: str, recursive: bool, with_entry: bool) -> None:
        self.where, self.path, self.recursive, self.with_entry = where, path, recursive, with_entry
        self.listing: Listing = {}

    async def changes(self) -> list[pb.FilesystemEvent]:
        now = await _look(self.where, self.path, self.recursive)
        found = _changes(self.path, self.listing, now, self.with_entry)
        self.listing = now
        return found


class FilesystemService(filesystem_connect.Filesystem):
    """The service, over `Reach` (the request's sandbox, as its owner)."""

    def __init__(self, reach: Reach) -> None:
        self.reach = reach
        self.watchers: dict[str, _Watcher] = {}

    async def stat(self, request: pb.StatRequest, ctx: RequestContext[Any, Any]) -> pb.StatResponse:
        where = self.reach(ctx)
        entry = await call(
            where.manager.fs_stat(where.id, request.path, user=where.user, owner=where.owner)
        )
        return pb.StatResponse(entry=entry_info(entry))

    async def list_dir(
        self, request: pb.ListDirRequest, ctx: RequestContext[Any, Any]
    ) -> pb.ListDirResponse:
        where = self.reach(ctx)
        entries = await call(
            where.manager.fs_list(
                where.id, request.path, request.depth or 1, user=where.user, owner=where.owner
            )
        )
        return pb.ListDirResponse(entries=[entry_info(e) for e in entries])

    async def make_dir(
        self, request: pb.MakeDirRequest, ctx: RequestContext[Any, Any]
    ) -> pb.MakeDirResponse:
        where = self.reach(ctx)
        made, entry = await call(
            where.manager.fs_make_dir(where.id, request.path, user=where.user, owner=where.owner)
        )
        if not made:
            raise ConnectError(Code.ALREADY_EXISTS, f"{request.path} already exists")
        return pb.MakeDirResponse(entry=entry_info(entry))

    async def move(self, request: pb.MoveRequest, ctx: RequestContext[Any, Any]) -> pb.MoveResponse:
        where = self.reach(ctx)
        entry = await call(
            where.manager.fs_move(
                where.id, request.source, request.destination, user=where.user, owner=where.owner
            )
        )
        return pb.MoveResponse(entry=entry_info(entry))

    async def remove(
        self, request: pb.RemoveRequest, ctx: RequestContext[Any, Any]
    ) -> pb.RemoveResponse:
        where = self.reach(ctx)
        await call(
            where.manager.fs_remove(where.id, request.path, user=where.user, owner=where.owner)
        )
        return pb.RemoveResponse()

    async def _watcher(self, ctx: RequestContext[Any, Any], request: Any) -> _Watcher:
        where = self.reach(ctx)
        top = await call(
            where.manager.fs_stat(where.id, request.path, user=where.user, owner=where.owner)
        )
        if top.type != "dir":
            raise ConnectError(Code.INVALID_ARGUMENT, f"{request.path} is not a directory")
        watcher = _Watcher(where, top.path, request.recursive, request.include_entry)
        watcher.listing = await _look(where, top.path, request.recursive)
        return watcher

    async def watch_dir(
        self, request: pb.WatchDirRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pb.WatchDirResponse]:
        watcher = await self._watcher(ctx, request)
        yield pb.WatchDirResponse(event=one("start", pb.WatchDirResponse.StartEvent()))
        quiet = 0.0
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            events = await watcher.changes()
            for event in events:
                yield pb.WatchDirResponse(event=one("filesystem", event))
            quiet = 0.0 if events else quiet + WATCH_PERIOD_S
            if quiet >= 30.0:
                quiet = 0.0
                keepalive = pb.WatchDirResponse.KeepAlive()
                yield pb.WatchDirResponse(event=one("keepalive", keepalive))

    async def create_watcher(
        self, request: pb.CreateWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> pb.CreateWatcherResponse:
        watcher = await self._watcher(ctx, request)
        while len(self.watchers) >= MAX_WATCHERS:
            self.watchers.pop(next(iter(self.watchers)))
        watcher_id = secrets.token_hex(12)
        self.watchers[watcher_id] = watcher
        return pb.CreateWatcherResponse(watcher_id=watcher_id)

    def _find(self, ctx: RequestContext[Any, Any], watcher_id: str) -> _Watcher:
        where = self.reach(ctx)
        watcher = self.watchers.get(watcher_id)
        if watcher is None or watcher.where.id != where.id:
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id!r} not found")
        self.watchers[watcher_id] = self.watchers.pop(watcher_id)  # the latest asked, last
        return watcher

    async def get_watcher_events(
        self, request: pb.GetWatcherEventsRequest, ctx: RequestContext[Any, Any]
    ) -> pb.GetWatcherEventsResponse:
        watcher = self._find(ctx, request.watcher_id)
        return pb.GetWatcherEventsResponse(events=await watcher.changes())

    async def remove_watcher(
        self, request: pb.RemoveWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> pb.RemoveWatcherResponse:
        self._find(ctx, request.watcher_id)
        self.watchers.pop(request.watcher_id, None)
        return pb.RemoveWatcherResponse()
