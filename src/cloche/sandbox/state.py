"""Per-server state directories, and finding the ones a crashed server left behind.

Each running server owns `<state_dir>/<instance>/` and holds an exclusive flock on
`<state_dir>/<instance>.lock` for as long as it runs (the lock file is locked before it
gets its name, so a visible lock file is always held by a live server or by nobody).
A directory named as servers name theirs (`<pid>-<6 hex digits>`) whose lock can be taken,
or that has no lock file, was left by a server that is gone: its leftovers are cleaned
before the new server starts. Servers running side by side never touch each other's
directories, and nothing else in the base is touched (a local cluster's `node-<i>/`
directories, each the base of a node agent's, live beside a server given the same base).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("cloche.sandbox")

_INSTANCE_NAME = re.compile(r"[0-9]+-[0-9a-f]{6}")  # as StateDir names them


class StateDir:
    """This server's state directory under the shared base directory."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.instance = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.path = base / self.instance
        self._lock_path = base / f"{self.instance}.lock"
        self._lock_fd: int | None = None

    def claim(self, clean_stale: Callable[[Path], None]) -> None:
        """Lock this server's name, clean stale siblings, create this server's directory."""
        self.base.mkdir(parents=True, exist_ok=True, mode=0o700)
        pending = self.base / f".{self.instance}.new"
        fd = os.open(pending, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(pending, self._lock_path)
        self._lock_fd = fd
        for sibling in sorted(self.base.iterdir()):
            if sibling.is_dir() and sibling != self.path:
                self._clean_if_stale(sibling, clean_stale)
        self.path.mkdir(mode=0o700)

    def sweep(self, clean_stale: Callable[[Path], None]) -> None:
        """Clean every stale directory under the base without claiming one; remove the base
        when nothing is left in it (a cluster's node directories, at the cluster's end)."""
        if not self.base.is_dir():
            return
        for sibling in sorted(self.base.iterdir()):
            if sibling.is_dir():
                self._clean_if_stale(sibling, clean_stale)
        with contextlib.suppress(OSError):
            self.base.rmdir()

    def _clean_if_stale(self, directory: Path, clean_stale: Callable[[Path], None]) -> None:
        if not _INSTANCE_NAME.fullmatch(directory.name):
            return  # not a server's: another's base (a cluster node's), or the operator's
        lock_path = directory.with_name(directory.name + ".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # a live server's
            log.warning("cleaning leftovers of a previous server in %s", directory)
            try:
                clean_stale(directory)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
                lock_path.unlink(missing_ok=True)
        finally:
            if fd is not None:
                os.close(fd)

    def release(self) -> None:
        """Remove this server's directory, then its lock. Idempotent."""
        if self._lock_fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        self._lock_path.unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = None
