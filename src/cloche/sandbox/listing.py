"""What a working directory holds: its regular files, walked following no symlink.

The walk opens each directory with ``O_NOFOLLOW | O_DIRECTORY`` from an fd on its parent,
so a symlink the sandbox swaps in is never followed; it looks at a bounded number of
entries and levels. Blocking: call it from a thread, never from the event loop.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cloche.protocol.paths import MAX_PATH_BYTES

MAX_WALK_ENTRIES = 10_000  # directory entries looked at by one list() or snapshot()
MAX_WALK_DEPTH = 32  # directories deeper are not walked (each level holds two fds)
# How every directory under a working directory is opened: never through a symlink.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Snapshot = dict[str, tuple[int, int]]
"""Relative path -> (size in bytes, mtime in ns) of each regular file."""

Found = list[tuple[str, os.stat_result]]  # (relative path, lstat) of regular files


class _Entries(Protocol):
    """What os.scandir(fd) returns."""

    def __next__(self) -> os.DirEntry[str]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class FileInfo:
    """A regular file in a working directory."""

    path: str  # POSIX, relative to the working directory
    size_bytes: int
    modified: float  # unix time, s


@dataclass(frozen=True)
class FileListing:
    """The regular files of a working directory, sorted by path."""

    files: tuple[FileInfo, ...]
    truncated: bool  # the walk hit MAX_WALK_ENTRIES or MAX_WALK_DEPTH: there may be more


def changed(before: Snapshot, after: Snapshot) -> list[str]:
    """Paths created or modified between two snapshots, sorted; deletions are left out.

    Args:
        before: A snapshot taken first.
        after: A snapshot taken later.

    Returns:
        Each path in ``after`` that was missing from ``before`` or has another size
        or mtime there.
    """
    return sorted(path for path, signature in after.items() if before.get(path) != signature)


def walk(root: Path, max_entries: int) -> tuple[Found, bool, int]:
    """Regular files under root with their lstat, sorted; whether the walk stopped early;
    and how many directory entries it looked at.

    Depth first, holding an fd and a scandir iterator per level, so that each
    directory is read lazily and a huge one costs no more than max_entries.
    """
    found: Found = []
    truncated = False
    seen = 0
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    stack: list[tuple[int, str, _Entries]] = []
    try:
        stack.append((top, "", os.scandir(top)))
    except BaseException:
        os.close(top)
        raise
    try:
        while stack:
            fd, prefix, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                stack.pop()
                entries.close()
                os.close(fd)
                continue
            seen += 1
            if seen > max_entries:
                truncated = True
                break
            path = prefix + entry.name
            if not _addressable(path):
                continue
            try:
                info = entry.stat(follow_symlinks=False)  # fstatat(fd, name, NOFOLLOW)
            except FileNotFoundError:
                continue  # deleted meanwhile
            if stat.S_ISREG(info.st_mode):
                found.append((path, info))
            elif stat.S_ISDIR(info.st_mode):
                if len(stack) > MAX_WALK_DEPTH:
                    truncated = True
                    continue
                try:
                    child = os.open(entry.name, DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue  # swapped for a symlink or removed meanwhile: skip it
                try:
                    stack.append((child, path + "/", os.scandir(child)))
                except BaseException:
                    os.close(child)
                    raise
    finally:
        for fd, _, entries in stack:
            entries.close()
            os.close(fd)
    found.sort(key=lambda item: item[0])
    return found, truncated, seen


def _addressable(path: str) -> bool:
    """Whether a client could name this path back (valid UTF-8, within PATH_MAX)."""
    try:
        return len(path.encode("utf-8")) <= MAX_PATH_BYTES
    except UnicodeEncodeError:
        return False
