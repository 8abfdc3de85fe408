"""What outlives the server process, under --data-dir: session records, paused sessions'
images and snapshots.

    <data-dir>/lock                      held (flock) by the one server using the directory
    <data-dir>/sessions/<id>/record.json a session's record: owner, profile, times, state
    <data-dir>/sessions/<id>/image/      its checkpoint, while it is paused
    <data-dir>/sessions/<id>/work.tar    its working directory, while it is paused
    <data-dir>/snapshots/<id>/...        the same for a snapshot

Everything is root-only (0700/0600): an image holds a session's memory. A record is
written whole (temporary file, then rename), so a crash leaves the old one or the new one.
A session's record says `live` while its sandbox runs: found so by a new server, it was
lost with the old one.
"""

from __future__ import annotations

import dataclasses
import enum
import fcntl
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloche.errors import ConfigError, StorageFull

log = logging.getLogger("cloche.store")

IMAGE = "image"
WORKDIR_ARCHIVE = "work.tar"


class RecordState(enum.Enum):
    """What a session's record says of it."""

    LIVE = "live"  # its sandbox runs in the server that wrote this
    PAUSED = "paused"  # its image is on disk, next to the record
    LOST = "lost"  # it was live when its server died; kept to say so until it expires


@dataclass(frozen=True)
class SessionRecord:
    id: str
    owner_key: str | None  # sha256 of the owner's token: the token itself is not stored
    profile: str
    created_at: float  # unix time, s
    last_active: float  # unix time, s
    execution_count: int
    state: RecordState
    origin: str = ""  # the runtime that made its image (see `Store.origin`)
    egress: dict[str, Any] | None = None  # its egress policy, as asked ({policy, allow?})
    metadata: dict[str, str] = field(default_factory=dict)  # its owner's labels
    cell_timeout_s: float | None = None  # its cells' default time limit, if its own
    paused_for: str = ""  # why it was paused (request, idle, room, shutdown, move)
    template: str = "python"  # the template its system is made of
    env: dict[str, str] = field(default_factory=dict)  # asked at its creation, for its commands
    volumes: list[dict[str, Any]] = field(default_factory=list)  # {name, path, read_only} each


@dataclass(frozen=True)
class SnapshotRecord:
    id: str
    session_id: str
    name: str
    owner_key: str | None
    profile: str
    created_at: float
    execution_count: int
    size_bytes: int
    origin: str
    egress: dict[str, Any] | None = None  # the session's egress policy when it was taken
    metadata: dict[str, str] = field(default_factory=dict)  # the session's, when taken
    template: str = "python"  # the template its system is made of
    env: dict[str, str] = field(default_factory=dict)  # the session's, for its commands
    volumes: list[dict[str, Any]] = field(default_factory=list)  # mounted again, not held


def _load(path: Path, kind: type[Any]) -> Any:
    raw = json.loads(path.read_text())
    if kind is SessionRecord:
        raw["state"] = RecordState(raw["state"])
    return kind(**raw)


def _dump(record: SessionRecord | SnapshotRecord) -> str:
    raw = dataclasses.asdict(record)
    if isinstance(record, SessionRecord):
        raw["state"] = record.state.value
    return json.dumps(raw)


class Store:
    """The data directory of one server."""

    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.sessions = root / "sessions"
        self.snapshots = root / "snapshots"
        self._lock_fd: int | None = None
        self.used_bytes = 0  # images and archives on disk, as last counted or added

    def open(self) -> None:
        """Create and lock the directory, and count what it holds.

        Raises:
            ConfigError: another server uses it.
        """
        for path in (self.root, self.sessions, self.snapshots):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)
        fd = os.open(self.root / "lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"the data directory {self.root} is in use by another cloche server: give "
                "each server its own --data-dir"
            ) from None
        self._lock_fd = fd
        # What the budget bounds: paused sessions and snapshots (not the templates built
        # beside them, nor the egress audit).
        self.used_bytes = _du(self.sessions) + _du(self.snapshots)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- records --------------------------------------------------------------------------

    def session_dir(self, session_id: str) -> Path:
        return self.sessions / session_id

    def snapshot_dir(self, snapshot_id: str) -> Path:
        return self.snapshots / snapshot_id

    def save(self, record: SessionRecord | SnapshotRecord) -> None:
        """Write a record whole (blocking; small)."""
        home = (
            self.session_dir(record.id)
            if isinstance(record, SessionRecord)
            else self.snapshot_dir(record.id)
        )
        home.mkdir(mode=0o700, exist_ok=True)
        temporary = home / "record.json.new"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(_dump(record))
        os.replace(temporary, home / "record.json")

    def session_record(self, session_id: str) -> SessionRecord:
        """One session's record. Raises OSError or ValueError when it is gone or damaged."""
        record: SessionRecord = _load(self.session_dir(session_id) / "record.json", SessionRecord)
        return record

    def session_records(self) -> list[SessionRecord]:
        return [r for r in self._records(self.sessions, SessionRecord) if r is not None]

    def snapshot_records(self) -> list[SnapshotRecord]:
        return [r for r in self._records(self.snapshots, SnapshotRecord) if r is not None]

    def _records(self, parent: Path, kind: type[Any]) -> list[Any]:
        found = []
        for home in sorted(parent.iterdir()):
            try:
                found.append(_load(home / "record.json", kind))
            except (OSError, ValueError, TypeError, KeyError) as exc:
                log.warning("unreadable record in %s, removed: %s", home, exc)
                self.remove(home)
        return found

    def forget_all(self) -> None:
        """Delete every session and snapshot kept here, unread (blocking): what a cluster
        node declared dead held, told lost, which its machine's next agent must not bring
        back (the node's agent fences itself so; one killed -9 could not)."""
        for parent in (self.sessions, self.snapshots):
            for home in sorted(parent.iterdir()):
                self.remove(home)

    def remove(self, path: Path) -> None:
        """Delete a file, or a directory with all it holds (blocking)."""
        freed = _du(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        self.used_bytes = max(0, self.used_bytes - freed)

    # -- space ----------------------------------------------------------------------------

    def reserve(self, expected_bytes: int) -> None:
        """Refuse a new image when it would take the directory past its budget.

        Raises:
            StorageFull: it would.
        """
        if self.used_bytes + expected_bytes > self.budget_bytes:
            raise StorageFull(
                f"the data directory {self.root} holds {self.used_bytes // 2**20} MiB of "
                f"its budget of {self.budget_bytes // 2**20} MiB (--data-max-mib): delete "
                "snapshots or sessions, or raise the budget"
            )

    def added(self, home: Path) -> int:
        """Count what was just written under home; its size in bytes."""
        size = _du(home)
        self.used_bytes += size
        return size


def _du(path: Path) -> int:
    """Bytes of the regular files under path (or of path, a file)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total
