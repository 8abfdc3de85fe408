"""Tenants' named volumes under --volumes-dir: found again at start, made, leased (mounted
while anything uses them), deleted.

    <volumes-dir>/lock                        held (flock) by the one server using it
    <volumes-dir>/<owner>/<name>/volume.json  {name, size_mib, created_at}
    <volumes-dir>/<owner>/<name>/image.ext4   its file system (`quota`), allocated in full
    <volumes-dir>/<owner>/<name>/mnt/         where it is mounted while leased
    <volumes-dir>/<owner>/<name>/mnt/data/    what sessions and the files API see
    <volumes-dir>/<owner>/<name>/ro/          data/ again, read-only on the host, while a
                                              session mounts the volume read-only

<owner> is the owner key (the SHA-256 of the tenant's token, as sessions' records hold it),
`_` on a server without tokens: names are per tenant, and another tenant's volume is not
found. Everything is root-only (0700) but `data/`, which belongs to the sandbox's user.

A volume is made under a temporary name and renamed into place, and deleted by a rename
away before its files go: a crash leaves a whole volume or none, and the next start
removes the rest. Whatever a crashed server left mounted under the directory is unmounted
at start. A volume is mounted while leased (by a sandbox, for its life; by a files
request, for its length) and unmounted when its last lease ends, so that idle volumes
hold no loop device or mount.

Blocking throughout: call it from a thread.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from cloche.config import MIB
from cloche.errors import ConfigError, VolumeError, VolumeExists, VolumeNotFound, VolumeRefused
from cloche.sandbox import mounts
from cloche.sandbox.bundle import USER_GID, USER_UID
from cloche.volumes import quota

log = logging.getLogger("cloche.volumes")

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RECORD = "volume.json"
IMAGE = "image.ext4"
MOUNT = "mnt"
READ_ONLY = "ro"  # data/ bound read-only on the host: runsc's own read-only binds leak
DATA = "data"  # in the volume's file system: what sessions see (lost+found stays beside)
NO_OWNER = "_"  # the owner directory of a server without tokens
_NEW = ".new-"  # volumes being made
_GONE = ".gone-"  # volumes being deleted
# The volume's root as sessions see it: any user of any template may write there (a
# volume is its tenant's, whoever runs in the sandbox); files the API writes are the
# default template user's.
DATA_MODE = 0o777

Key = tuple[str | None, str]  # (owner key, name)


@dataclass(frozen=True)
class Volume:
    """One volume's record."""

    owner_key: str | None
    name: str
    size_mib: int
    created_at: float  # unix time, s


class Lease:
    """A volume mounted for one user (a sandbox, a files request): `directory` is what it
    sees; `release()` once it no longer needs it (idempotent)."""

    def __init__(self, store: VolumeStore, key: Key, directory: Path, read_only: bool) -> None:
        self.directory = directory
        self.read_only = read_only
        self._store = store
        self._key = key
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._store._release(self._key, self.read_only)


class VolumeStore:
    """The volumes of one server, under root.

    Args:
        root: --volumes-dir.
        max_mib: the largest size one volume may have (--volume-max-mib).
    """

    def __init__(self, root: Path, max_mib: int) -> None:
        self.root = root
        self.max_mib = max_mib
        self._volumes: dict[Key, Volume] = {}
        self._leases: Counter[Key] = Counter()
        self._read_only: Counter[Key] = Counter()  # the leases of them that are read-only
        self._usage: dict[Key, tuple[int, int]] = {}  # measured at the last unmount
        self._lock = threading.RLock()
        self._lock_fd: int | None = None

    # -- the directory --------------------------------------------------------------------

    def open(self) -> None:
        """Lock the directory, unmount what a crashed server left mounted, finish what it
        left half-made or half-deleted, and find every volume again.

        Raises:
            ConfigError: another server uses it, or it can't be made.
        """
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.root / "lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(f"--volumes-dir {self.root} can't be used: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"the volumes directory {self.root} is in use by another cloche server: give "
                "each server its own --volumes-dir"
            ) from None
        self._lock_fd = fd
        for point in mounts.mounts_under(self.root):  # a crashed server's
            log.warning("unmounting %s, left mounted by a server that stopped", point)
            mounts.unmount(point)
        for owner in sorted(self.root.iterdir()):
            if owner.is_dir() and not owner.is_symlink():
                self._load_owner(owner)
        log.info("volumes dir %s: %d volumes", self.root, len(self._volumes))

    def _load_owner(self, owner: Path) -> None:
        key = None if owner.name == NO_OWNER else owner.name
        for home in sorted(owner.iterdir()):
            if home.name.startswith((_NEW, _GONE)):
                shutil.rmtree(home, ignore_errors=True)
                continue
            try:
                raw = json.loads((home / RECORD).read_text())
                volume = Volume(
                    key, str(raw["name"]), int(raw["size_mib"]), float(raw["created_at"])
                )
                if volume.name != home.name or not (home / IMAGE).is_file():
                    raise ValueError("its record or image does not match its directory")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("volume directory %s is unreadable and left alone: %s", home, exc)
                continue
            self._volumes[(key, volume.name)] = volume

    def close(self) -> None:
        """Unmount every volume (their leases are over: the sandboxes are gone) and let the
        directory go."""
        with self._lock:
            for point in mounts.mounts_under(self.root):
                mounts.unmount(point)
            self._leases.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _home(self, key: Key) -> Path:
        return self.root / (key[0] or NO_OWNER) / key[1]

    # -- volumes --------------------------------------------------------------------------

    def create(self, owner_key: str | None, name: str, size_mib: int) -> Volume:
        """Make an empty volume of size_mib.

        Raises:
            VolumeRefused: a bad name or size.
            VolumeExists: the owner has one of that name.
            VolumeError: the host has no room for it, or it could not be formatted.
        """
        check_name(name)
        if not isinstance(size_mib, int) or not 1 <= size_mib <= self.max_mib:
            raise VolumeRefused(
                f"size_mib is a whole number of MiB from 1 to {self.max_mib} "
                f"(--volume-max-mib), not {size_mib!r}"
            )
        key = (owner_key, name)
        with self._lock:
            if key in self._volumes:
                raise VolumeExists(f"a volume named {name!r} exists already: delete it first")
            volume = Volume(owner_key, name, size_mib, time.time())
            home = self._home(key)
            home.parent.mkdir(mode=0o700, exist_ok=True)
            making = home.with_name(f"{_NEW}{secrets.token_hex(8)}")
            try:
                making.mkdir(mode=0o700)
                (making / MOUNT).mkdir(mode=0o700)
                (making / READ_ONLY).mkdir(mode=0o700)
                quota.make_image(making / IMAGE, size_mib)
                self._first_mount(making)
                record = {k: v for k, v in asdict(volume).items() if k != "owner_key"}
                (making / RECORD).write_text(json.dumps(record))
                os.rename(making, home)
            except BaseException as exc:
                mounts.unmount(making / MOUNT)
                shutil.rmtree(making, ignore_errors=True)
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise VolumeError(
                        f"the host has no room for a volume of {size_mib} MiB in "
                        f"{self.root} (--volumes-dir): free disk space or ask for less"
                    ) from exc
                if isinstance(exc, OSError):
                    raise VolumeError(f"the volume could not be made: {exc}") from exc
                raise
            self._volumes[key] = volume
        log.info("volume created name=%s size_mib=%d", name, size_mib)
        return volume

    def _first_mount(self, home: Path) -> None:
        """Make the volume's data directory, the sandbox's user's, in its new file system."""
        point = home / MOUNT
        quota.mount_image(home / IMAGE, point)
        try:
            data = point / DATA
            data.mkdir()
            os.chown(data, USER_UID, USER_GID)
            data.chmod(DATA_MODE)
            point.chmod(0o700)
        finally:
            mounts.unmount(point)

    def get(self, owner_key: str | None, name: str) -> Volume:
        """The owner's volume of that name. Raises VolumeNotFound."""
        volume = self._volumes.get((owner_key, name))
        if volume is None:
            raise VolumeNotFound(name)
        return volume

    def of_owner(self, owner_key: str | None) -> list[Volume]:
        """The owner's volumes, by name."""
        found = [v for (owner, _), v in self._volumes.items() if owner == owner_key]
        return sorted(found, key=lambda v: v.name)

    def all(self) -> list[Volume]:
        """Every owner's volumes."""
        return list(self._volumes.values())

    def delete(self, owner_key: str | None, name: str) -> None:
        """Delete a volume and its files (whoever still holds a lease keeps what it has
        open until it lets go; the caller has made sure no session mounts it).

        Raises:
            VolumeNotFound: the owner has none of that name.
        """
        key = (owner_key, name)
        with self._lock:
            self.get(owner_key, name)
            home = self._home(key)
            mounts.unmount(home / READ_ONLY)
            mounts.unmount(home / MOUNT)
            gone = home.with_name(f"{_GONE}{secrets.token_hex(8)}")
            os.rename(home, gone)
            del self._volumes[key]
            self._leases.pop(key, None)
            self._read_only.pop(key, None)
            self._usage.pop(key, None)
        shutil.rmtree(gone, ignore_errors=True)
        log.info("volume deleted name=%s", name)

    # -- leases ---------------------------------------------------------------------------

    def lease(self, owner_key: str | None, name: str, read_only: bool = False) -> Lease:
        """The volume mounted (if it was not) for one more user; read_only: its files
        through a view the host itself keeps read-only.

        Raises:
            VolumeNotFound: the owner has none of that name.
            VolumeError: it could not be mounted.
        """
        key = (owner_key, name)
        with self._lock:
            self.get(owner_key, name)
            home = self._home(key)
            if self._leases[key] == 0:
                quota.mount_image(home / IMAGE, home / MOUNT)
            self._leases[key] += 1
            if read_only:
                try:
                    if self._read_only[key] == 0:
                        (home / READ_ONLY).mkdir(mode=0o700, exist_ok=True)
                        mounts.bind_read_only(home / MOUNT / DATA, home / READ_ONLY)
                except BaseException:
                    self._release(key, False)
                    raise
                self._read_only[key] += 1
        return Lease(self, key, home / (READ_ONLY if read_only else f"{MOUNT}/{DATA}"), read_only)

    def _release(self, key: Key, read_only: bool) -> None:
        with self._lock:
            if self._leases[key] <= 0 or key not in self._volumes:
                return
            home = self._home(key)
            if read_only and self._read_only[key] > 0:
                self._read_only[key] -= 1
                if self._read_only[key] == 0:
                    del self._read_only[key]
                    mounts.unmount(home / READ_ONLY)
            self._leases[key] -= 1
            if self._leases[key] == 0:
                del self._leases[key]
                try:
                    self._usage[key] = quota.usage(home / MOUNT)
                except OSError:
                    pass
                mounts.unmount(home / MOUNT)

    def usage(self, volume: Volume) -> tuple[int, int]:
        """(used, capacity) in bytes: what its files take, and what they may take in all
        (its size less its file system's metadata). Mounted briefly when it is not and
        was not measured since the server started.

        Raises:
            VolumeNotFound: it was deleted meanwhile.
        """
        key = (volume.owner_key, volume.name)
        with self._lock:
            if self._leases[key] > 0:
                return quota.usage(self._home(key) / MOUNT)
            if key in self._usage:
                return self._usage[key]
        lease = self.lease(volume.owner_key, volume.name)
        lease.release()  # measured as it is unmounted
        return self._usage.get(key, (0, volume.size_mib * MIB))

    def mounted(self) -> int:
        """How many volumes are mounted now."""
        with self._lock:
            return sum(1 for count in self._leases.values() if count > 0)


def check_name(name: object) -> str:
    """A volume's name: 1-64 of letters, digits, `_`, `.`, `-`, not starting with `.`, `_`
    or `-`. Raises VolumeRefused."""
    if not isinstance(name, str) or not NAME.match(name):
        raise VolumeRefused(
            f"a volume's name is 1-64 letters, digits, '_', '.' and '-', starting with a "
            f"letter or digit, not {name!r}"
        )
    return name
