"""Volumes as front ends reach them: every session manager has these verbs; one that can't
serve them (a cluster's front end) says so (NotSupported).

A volume is named per tenant (the owner's token): another tenant's is not found, and may
have the same name. Its files are reached without a session through the verbs here; a
session mounts volumes by name when it is made (`SessionManager.create(volumes=...)`).
The one machine's verbs are `sessions.mounts`'s.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, AsyncIterable
from dataclasses import dataclass
from typing import Any

from cloche.errors import NotSupported
from cloche.sandbox.listing import FileListing

NOT_HERE = (
    "volumes live on one machine and are not offered over a cluster (--cluster): a volume "
    "is a file system mounted by one host's kernel, which the cluster's nodes can't share; "
    "use them on a server without --cluster"
)


@dataclass(frozen=True)
class VolumeInfo:
    """What can be told of a volume."""

    name: str
    size_mib: int  # what it may never grow past
    created_at: float  # unix time, s
    used_bytes: int  # what its files take now
    capacity_bytes: int  # what its files may take in all (its size less its metadata)
    sessions: tuple[str, ...] = ()  # live or paused sessions that mount it

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "size_mib": self.size_mib,
            "created_at": self.created_at,
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "sessions": list(self.sessions),
        }


class VolumeVerbs(abc.ABC):  # noqa: B024  # every verb has a default: it says it can't
    """The owner's volumes and their files. All raise VolumeNotFound for a name the owner
    has no volume of; paths are relative to the volume's root, and PathRefused refuses
    `..`, absolute paths and any symlink on the way (never followed)."""

    async def create_volume(self, name: str, size_mib: int, owner: str | None = None) -> VolumeInfo:
        """Make an empty volume of size_mib.

        Raises:
            VolumeRefused: a bad name or size.
            VolumeExists: the owner has one of that name.
            QuotaExceeded: the owner's volumes would pass its max_volume_bytes.
        """
        raise NotSupported(NOT_HERE)

    async def volumes(self, owner: str | None = None) -> list[VolumeInfo]:
        """The owner's volumes, by name."""
        raise NotSupported(NOT_HERE)

    async def volume(self, name: str, owner: str | None = None) -> VolumeInfo:
        """One of the owner's volumes."""
        raise NotSupported(NOT_HERE)

    async def delete_volume(self, name: str, owner: str | None = None) -> None:
        """Delete a volume and its files (snapshots that mount it may no longer be restored).

        Raises:
            VolumeInUse: a live or paused session mounts it.
        """
        raise NotSupported(NOT_HERE)

    async def volume_files(self, name: str, owner: str | None = None) -> FileListing:
        """The regular files of a volume."""
        raise NotSupported(NOT_HERE)

    async def read_volume_file(
        self, name: str, path: str, owner: str | None = None
    ) -> tuple[int, AsyncGenerator[bytes, None]]:
        """A file of a volume in pieces, and its size (read the pieces to the end, or close
        the iterator). Raises PathNotFound, PathRefused before any piece."""
        raise NotSupported(NOT_HERE)

    async def write_volume_file(
        self, name: str, path: str, chunks: AsyncIterable[bytes], owner: str | None = None
    ) -> int:
        """Create or replace a file (its directories made) from chunks; its size. Nothing is
        left of it when it fails.

        Raises:
            PathRefused: a bad path, or a directory or symlink in the way.
            VolumeFull: it would take the volume past its size.
        """
        raise NotSupported(NOT_HERE)

    async def delete_volume_file(self, name: str, path: str, owner: str | None = None) -> None:
        """Remove a file, a symlink or a directory with all it holds. Raises PathNotFound."""
        raise NotSupported(NOT_HERE)


class ForwardedVolumeVerbs(VolumeVerbs):
    """The volume verbs of a manager that wraps another (`inner`): passed on as they are."""

    @property
    def _volume_verbs(self) -> VolumeVerbs:
        inner: VolumeVerbs = getattr(self, "inner")  # noqa: B009  # the wrapper's own
        return inner

    async def create_volume(self, *args: Any, **kwargs: Any) -> VolumeInfo:
        return await self._volume_verbs.create_volume(*args, **kwargs)

    async def volumes(self, *args: Any, **kwargs: Any) -> list[VolumeInfo]:
        return await self._volume_verbs.volumes(*args, **kwargs)

    async def volume(self, *args: Any, **kwargs: Any) -> VolumeInfo:
        return await self._volume_verbs.volume(*args, **kwargs)

    async def delete_volume(self, *args: Any, **kwargs: Any) -> None:
        await self._volume_verbs.delete_volume(*args, **kwargs)

    async def volume_files(self, *args: Any, **kwargs: Any) -> FileListing:
        return await self._volume_verbs.volume_files(*args, **kwargs)

    async def read_volume_file(
        self, *args: Any, **kwargs: Any
    ) -> tuple[int, AsyncGenerator[bytes, None]]:
        return await self._volume_verbs.read_volume_file(*args, **kwargs)

    async def write_volume_file(self, *args: Any, **kwargs: Any) -> int:
        return await self._volume_verbs.write_volume_file(*args, **kwargs)

    async def delete_volume_file(self, *args: Any, **kwargs: Any) -> None:
        await self._volume_verbs.delete_volume_file(*args, **kwargs)
