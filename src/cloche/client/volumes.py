"""Volumes over the HTTP API: files that outlive sessions. The verbs of `AsyncClient`
(`AsyncVolumeVerbs`) and of the blocking `Client` (`VolumeVerbs`):

    volume = client.create_volume("data", size_mib=512)
    client.upload_to_volume("data", "raw/sales.csv", open("sales.csv", "rb").read())
    with client.create_session(volumes=["data"]) as session:   # at /mnt/data
        session.run("import pandas as pd; pd.read_csv('/mnt/data/raw/sales.csv')")
    client.download_from_volume("data", "raw/sales.csv")

A volume is this token's (another token's is not found, and may have the same name); it
never holds more than its size (a write past it fails with ENOSPC inside, VolumeFull
here); several sessions may mount it at once, read-write or read-only.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from cloche.client._files import FileData, encode, file_url
from cloche.client.info import FileInfo

if TYPE_CHECKING:
    import httpx

    from cloche.client._loop import LoopThread
    from cloche.client.aio import AsyncClient

VolumeAsk = str | Mapping[str, Any]  # a name (mounted at /mnt/NAME), or {name, path, read_only}


@dataclasses.dataclass(frozen=True)
class VolumeInfo:
    """What the server says about a volume."""

    name: str
    size_mib: int  # it never holds more
    created_at: datetime.datetime
    used_bytes: int  # what its files take now
    capacity_bytes: int  # what they may take in all (its size less its metadata)
    sessions: tuple[str, ...] = ()  # live or paused sessions that mount it

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> VolumeInfo:
        return cls(
            name=str(body["name"]),
            size_mib=int(body["size_mib"]),
            created_at=datetime.datetime.fromisoformat(body["created_at"]),
            used_bytes=int(body.get("used_bytes", 0)),
            capacity_bytes=int(body.get("capacity_bytes", 0)),
            sessions=tuple(str(s) for s in body.get("sessions") or ()),
        )


def mounts(volumes: Sequence[VolumeAsk]) -> list[dict[str, Any]]:
    """What `create_session(volumes=...)` sends: each a name or {name, path?, read_only?}."""
    return [{"name": v} if isinstance(v, str) else dict(v) for v in volumes]


def _volume(name: str) -> str:
    return f"/v1/volumes/{quote(name, safe='')}"


class AsyncVolumeVerbs:
    """`AsyncClient`'s volume verbs. Each raises VolumeNotFound for a name this token has no
    volume of."""

    if TYPE_CHECKING:

        async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response: ...

    async def create_volume(self, name: str, size_mib: int) -> VolumeInfo:
        """Make an empty volume of size_mib (allocated in full on the server).

        Raises:
            VolumeExists: this token has one of that name.
            VolumeRefused: a bad name, or a size above the server's --volume-max-mib.
            QuotaExceeded: the tenant's volumes would pass its max_volume_bytes.
        """
        body = {"name": name, "size_mib": size_mib}
        response = await self._request("POST", "/v1/volumes", json=body)
        return VolumeInfo.from_json(response.json())

    async def volumes(self) -> list[VolumeInfo]:
        """This token's volumes, by name."""
        response = await self._request("GET", "/v1/volumes")
        return [VolumeInfo.from_json(item) for item in response.json()["volumes"]]

    async def volume(self, name: str) -> VolumeInfo:
        """One volume: its size, what its files take, the sessions that mount it."""
        return VolumeInfo.from_json((await self._request("GET", _volume(name))).json())

    async def delete_volume(self, name: str) -> None:
        """Delete a volume and its files. Raises VolumeInUse while a live or paused
        session mounts it."""
        await self._request("DELETE", _volume(name))

    async def volume_files(self, name: str) -> list[FileInfo]:
        """The files of a volume, recursively."""
        response = await self._request("GET", f"{_volume(name)}/files")
        return [
            FileInfo(path=f["path"], size_bytes=int(f["size_bytes"]), modified=float(f["modified"]))
            for f in response.json()["files"]
        ]

    async def upload_to_volume(self, name: str, path: str, data: FileData) -> None:
        """Write a file into a volume (its directories made).

        Raises:
            PathRefused: a path that leads out of the volume, or a symlink on the way.
            VolumeFull: it would take the volume past its size (nothing of it is left).
        """
        await self._request(
            "PUT", f"{_volume(name)}/files/{file_url(path)}", content=encode(data), file_path=path
        )

    async def download_from_volume(self, name: str, path: str) -> bytes:
        """A file of a volume. Raises PathNotFound, PathRefused (a symlink: never followed)."""
        url = f"{_volume(name)}/files/{file_url(path)}"
        return (await self._request("GET", url, file_path=path)).content

    async def delete_from_volume(self, name: str, path: str) -> None:
        """Remove a file, a symlink or a directory (with what it holds) of a volume."""
        url = f"{_volume(name)}/files/{file_url(path)}"
        await self._request("DELETE", url, file_path=path)


class VolumeVerbs:
    """The blocking `Client`'s volume verbs: `AsyncVolumeVerbs`' on its loop."""

    if TYPE_CHECKING:
        _loop: LoopThread
        _async: AsyncClient

    def create_volume(self, name: str, size_mib: int) -> VolumeInfo:
        """See `AsyncVolumeVerbs.create_volume`."""
        return self._loop.call(self._async.create_volume(name, size_mib))

    def volumes(self) -> list[VolumeInfo]:
        return self._loop.call(self._async.volumes())

    def volume(self, name: str) -> VolumeInfo:
        return self._loop.call(self._async.volume(name))

    def delete_volume(self, name: str) -> None:
        self._loop.call(self._async.delete_volume(name))

    def volume_files(self, name: str) -> list[FileInfo]:
        return self._loop.call(self._async.volume_files(name))

    def upload_to_volume(self, name: str, path: str, data: FileData) -> None:
        self._loop.call(self._async.upload_to_volume(name, path, data))

    def download_from_volume(self, name: str, path: str) -> bytes:
        return self._loop.call(self._async.download_from_volume(name, path))

    def delete_from_volume(self, name: str, path: str) -> None:
        self._loop.call(self._async.delete_from_volume(name, path))
