"""Volumes on one machine: the volume verbs over `volumes.store`, and a session's volumes
mounted into each sandbox it runs on.

A layer of `LocalSessionManager` (`sessions.local`), over `sessions.core`, under
`sessions.creation`. A
session keeps the volumes it mounts (name, path, read_only) in its record, never their
files: every sandbox it runs on (its first, a resumed one, a restarted one, a snapshot's
restore, a fork's copies) gets them bound again by name, with their contents of the
moment. Each such sandbox takes a lease on each volume for itself (`_volume_setup`), let
go when the sandbox is freed; a volume is mounted on the host while leased.

A volume can't be deleted while a live or paused session mounts it, nor while a session
that will mount it is being made (`_claim_volumes`): the check and the claim are made in
one step on the event loop, so a deletion and a creation can't pass each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterable, Iterable, Iterator, Mapping
from typing import Any

from cloche.errors import ClocheError, NotSupported, VolumeInUse, VolumeNotFound, VolumeRefused
from cloche.sandbox.base import Sandbox, SandboxSetup
from cloche.sandbox.bundle import HOME, VolumeBind
from cloche.sandbox.listing import FileListing
from cloche.sessions.core import LiveSessions
from cloche.sessions.manager import READ_PIECE_BYTES
from cloche.sessions.profiles import PYTHON
from cloche.sessions.session import owner_key
from cloche.sessions.volumes import VolumeInfo
from cloche.volumes import quota
from cloche.volumes.files import VolumeFiles
from cloche.volumes.paths import VolumeMount, check_mounts
from cloche.volumes.store import Key, Lease, Volume, VolumeStore

log = logging.getLogger("cloche.volumes")
FLUSH_BYTES = 1 << 20  # a streamed file is written in pieces of about this size


class VolumeSessions(LiveSessions):
    """Live sessions that mount volumes, and the volumes themselves."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._claims: Counter[Key] = Counter()  # sessions being made that will mount them
        self._deleting: set[Key] = set()

    @functools.cached_property
    def volume_store(self) -> VolumeStore:
        """The volumes of this machine (--volumes-dir)."""
        return VolumeStore(self.config.volumes_root, self.config.volume_max_mib)

    # -- a session's volumes ----------------------------------------------------------------

    def _volume_mounts(
        self, asked: Iterable[Mapping[str, Any]] | None, template: str = PYTHON
    ) -> list[VolumeMount]:
        """What a new session asked to mount, checked (before a sandbox is taken).

        Raises:
            VolumeRefused: a bad name or path.
            NotSupported: this backend binds no volumes.
        """
        if asked is None:
            return []
        if isinstance(asked, (str, bytes, Mapping)):
            raise VolumeRefused('volumes is a list of {"name", "path", "read_only"}')
        items = list(asked)
        if not items:
            return []
        if not self.backend.can_mount_volumes:
            raise NotSupported(f"the {self.backend.name} backend mounts no volumes into sessions")
        home = HOME
        if template != PYTHON:
            with contextlib.suppress(ClocheError):  # its own error comes when it is used
                home = self._system_of(template).home
        return check_mounts(items, home=home, reserved=self.backend.reserved_paths())

    @contextlib.contextmanager
    def _claim_volumes(
        self, key: str | None, mounts: list[VolumeMount], why: str = ""
    ) -> Iterator[None]:
        """Hold the owner's volumes against deletion while a session that mounts them is
        made (checked and claimed at once, on the event loop).

        Raises:
            VolumeNotFound: one of them is gone (why says what asked for it).
        """
        claimed = [(key, m.name) for m in mounts]
        for owner, name in claimed:
            self._volume(owner, name, why)
        self._claims.update(claimed)
        try:
            yield
        finally:
            self._claims.subtract(claimed)
            self._claims = +self._claims

    def _volume(self, key: str | None, name: str, why: str = "") -> Volume:
        if (key, name) in self._deleting:
            raise VolumeNotFound(name, why)
        try:
            return self.volume_store.get(key, name)
        except VolumeNotFound:
            raise VolumeNotFound(name, why) from None

    def _volume_setup(self, key: str | None, mounts: list[VolumeMount]) -> SandboxSetup | None:
        """What binds the volumes into a new sandbox, each from a lease of its own, let go
        when the sandbox is freed; None when there are none."""
        if not mounts:
            return None
        store = self.volume_store

        def lease_all() -> list[Lease]:
            leases: list[Lease] = []
            try:
                for mount in mounts:
                    leases.append(store.lease(key, mount.name, mount.read_only))
            except BaseException:
                for lease in leases:
                    lease.release()
                raise
            return leases

        async def setup(sandbox: Sandbox) -> None:
            leases = await asyncio.to_thread(lease_all)
            sandbox.volumes = [
                VolumeBind(lease.directory, mount.path, mount.read_only)
                for mount, lease in zip(mounts, leases, strict=True)
            ]
            sandbox.when_freed.extend(lease.release for lease in leases)

        return setup

    def _volume_users(self, key: str | None, name: str) -> list[str]:
        """The live or paused sessions of the owner that mount the volume."""
        return [
            s.id
            for s in self._sessions.values()
            if s.owner_key == key and any(m.name == name for m in s.volumes)
        ]

    # -- the volume verbs -------------------------------------------------------------------

    async def create_volume(self, name: str, size_mib: int, owner: str | None = None) -> VolumeInfo:
        key = owner_key(owner)
        volume = await asyncio.to_thread(self.volume_store.create, key, name, size_mib)
        self.observer.event("volume.created", None, key, {"name": name, "size_mib": size_mib})
        return await self._info(volume)

    async def volumes(self, owner: str | None = None) -> list[VolumeInfo]:
        key = owner_key(owner)
        found = [v for v in self.volume_store.of_owner(key) if (key, v.name) not in self._deleting]
        infos = []
        for volume in found:
            with contextlib.suppress(VolumeNotFound):  # deleted meanwhile
                infos.append(await self._info(volume))
        return infos

    async def volume(self, name: str, owner: str | None = None) -> VolumeInfo:
        return await self._info(self._volume(owner_key(owner), name))

    async def _info(self, volume: Volume) -> VolumeInfo:
        used, capacity = await asyncio.to_thread(self.volume_store.usage, volume)
        return VolumeInfo(
            name=volume.name,
            size_mib=volume.size_mib,
            created_at=volume.created_at,
            used_bytes=used,
            capacity_bytes=capacity,
            sessions=tuple(self._volume_users(volume.owner_key, volume.name)),
        )

    async def delete_volume(self, name: str, owner: str | None = None) -> None:
        key = owner_key(owner)
        volume = self._volume(key, name)
        users = self._volume_users(key, name)
        if users or self._claims[(key, name)]:
            which = f" ({', '.join(users[:4])}{', ...' if len(users) > 4 else ''})" if users else ""
            raise VolumeInUse(
                f"volume {name!r} is mounted by {len(users) or 'a new'} live or paused "
                f"session{'s' if len(users) != 1 else ''}{which}: close them first"
            )
        self._deleting.add(key_of(volume))
        try:
            await asyncio.to_thread(self.volume_store.delete, key, name)
        finally:
            self._deleting.discard(key_of(volume))
        self.observer.event("volume.deleted", None, key, {"name": name})

    async def volume_files(self, name: str, owner: str | None = None) -> FileListing:
        files, lease = await self._volume_files(name, owner)
        try:
            return await asyncio.to_thread(files.list)
        finally:
            await asyncio.to_thread(lease.release)

    async def read_volume_file(
        self, name: str, path: str, owner: str | None = None
    ) -> tuple[int, AsyncGenerator[bytes, None]]:
        files, lease = await self._volume_files(name, owner)
        try:
            fd, size = await asyncio.to_thread(files.open_for_reading, path)
        except BaseException:
            await asyncio.to_thread(lease.release)
            raise
        return size, _pieces(fd, size, lease)

    async def write_volume_file(
        self, name: str, path: str, chunks: AsyncIterable[bytes], owner: str | None = None
    ) -> int:
        files, lease = await self._volume_files(name, owner)
        try:
            streamed = files.streamed(path)
            await asyncio.to_thread(streamed.open)
            try:
                buffer = bytearray()
                async for chunk in chunks:
                    buffer += chunk
                    if len(buffer) >= FLUSH_BYTES:
                        await asyncio.to_thread(streamed.write, bytes(buffer))
                        buffer.clear()
                await asyncio.to_thread(streamed.write, bytes(buffer))
                await asyncio.to_thread(streamed.finish)
            finally:
                await asyncio.to_thread(streamed.discard)
            return streamed.size
        finally:
            await asyncio.to_thread(lease.release)

    async def delete_volume_file(self, name: str, path: str, owner: str | None = None) -> None:
        files, lease = await self._volume_files(name, owner)
        try:
            await asyncio.to_thread(files.delete, path)
        finally:
            await asyncio.to_thread(lease.release)

    async def _volume_files(self, name: str, owner: str | None) -> tuple[VolumeFiles, Lease]:
        """The volume's files, on a lease the caller lets go."""
        key = owner_key(owner)
        self._volume(key, name)
        lease = await asyncio.to_thread(self.volume_store.lease, key, name)
        try:
            _, capacity = await asyncio.to_thread(quota.usage, lease.directory)
        except BaseException:
            await asyncio.to_thread(lease.release)
            raise
        return VolumeFiles(lease.directory, name, capacity), lease


def key_of(volume: Volume) -> Key:
    return (volume.owner_key, volume.name)


async def _pieces(fd: int, size: int, lease: Lease) -> AsyncGenerator[bytes, None]:
    """An open file's first size bytes in pieces; the descriptor closed and the lease let
    go at the end."""
    try:
        left = size
        while left > 0:
            piece = await asyncio.to_thread(os.read, fd, min(READ_PIECE_BYTES, left))
            if not piece:
                break
            left -= len(piece)
            yield piece
    finally:
        os.close(fd)
        await asyncio.to_thread(lease.release)
