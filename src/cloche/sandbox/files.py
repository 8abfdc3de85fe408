"""The server's hands in a session's working directory, which hostile code writes.

The sandbox can create symlinks, FIFOs and deep trees there, and swap any of them
in between two of our system calls. So every path is walked one component at a
time from a file descriptor on the root, opening each directory with
``O_NOFOLLOW | O_DIRECTORY`` and the final file with ``O_NOFOLLOW``: no symlink is
followed anywhere, whatever the sandbox does meanwhile. Files are written to a
fresh temporary name and renamed into place, so an existing inode (perhaps a hard
link) is never written through, and only inodes we just created are chowned.

Everything here blocks: call it from a thread, never from the event loop. What a
working directory holds (its listing, its snapshots) is walked in `listing.py`.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from cloche.errors import PathNotFound, PathRefused
from cloche.protocol.paths import normalise
from cloche.sandbox.listing import (
    DIR_FLAGS,
    MAX_WALK_ENTRIES,
    FileInfo,
    FileListing,
    Found,
    Snapshot,
    walk,
)

DIR_MODE = 0o755
FILE_MODE = 0o644

# O_NONBLOCK: opening a FIFO swapped in after our lstat must not hang the server.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
_READ_CHUNK_BYTES = 1 << 20
_TEMP_ATTEMPTS = 8


class WorkdirFiles:
    """Read, write and list files under a root the sandbox controls, never leaving it.

    Args:
        root: The working directory on the host (trusted: every walk starts there).
        uid: Owner given to the files and directories we create; None leaves ours.
        gid: Group given to the files and directories we create; None leaves ours.
        max_file_bytes: Largest file that read and write accept.
    """

    def __init__(self, root: Path, uid: int | None, gid: int | None, max_file_bytes: int) -> None:
        self.root = root
        self.uid = uid
        self.gid = gid
        self.max_file_bytes = max_file_bytes
        self.last_walk_entries = 0  # directory entries the last list() or snapshot() saw

    def write(self, relative: str, data: bytes) -> None:
        """Create or replace a file, creating missing parent directories.

        The data goes to a new temporary file in the same directory, which is then
        renamed over the target: readers see the old or the new content, and an
        existing target (even a hard link) is replaced, never written through.
        New files get mode 0o644, new directories 0o755, both owned by uid:gid.

        Args:
            relative: Path of the file, relative to the working directory.
            data: The whole new content.

        Raises:
            PathRefused: The path is refused by `normalise`, a component on the way is
                a symlink or not a directory, the target is a symlink, a directory or
                a special file, the data is over max_file_bytes, or the working
                directory is full.
        """
        path = normalise(relative)
        if len(data) > self.max_file_bytes:
            raise PathRefused(path, self._too_large(len(data)))
        *directories, name = path.split("/")
        parent = self._open_directory(path, directories, create=True)
        try:
            existing = _lstat(parent, name)
            if existing is not None and not stat.S_ISREG(existing.st_mode):
                raise PathRefused(path, _describe(existing.st_mode))
            temp = self._write_temp(parent, path, data)
            try:
                # rename replaces whatever the sandbox put there since: it never follows it.
                os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except OSError as exc:
                _unlink_quietly(parent, temp)
                _refuse(path, exc)
            except BaseException:
                _unlink_quietly(parent, temp)
                raise
        finally:
            os.close(parent)

    def read(self, relative: str) -> bytes:
        """The content of a regular file.

        Args:
            relative: Path of the file, relative to the working directory.

        Returns:
            All its bytes.

        Raises:
            PathNotFound: There is no such file, or a directory on the way is missing.
            PathRefused: The path is refused by `normalise`, a component on the way is
                a symlink or not a directory, or the file is a symlink, a directory, a
                FIFO or another special file, or is over max_file_bytes.
        """
        fd, _ = self.open_for_reading(relative)
        try:
            return self._read_at_most(fd, normalise(relative))
        finally:
            os.close(fd)

    def open_for_reading(self, relative: str) -> tuple[int, int]:
        """A regular file opened for reading, and its size: for reading it in pieces (the
        caller closes the descriptor, and reads no more than the size). Raises as `read`."""
        path = normalise(relative)
        *directories, name = path.split("/")
        parent = self._open_directory(path, directories, create=False)
        try:
            found = _lstat(parent, name)
            if found is None:
                raise PathNotFound(path)
            self._check_readable(path, found)
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                raise PathNotFound(path) from None
            except OSError as exc:
                _refuse(path, exc, parent, name)
        finally:
            os.close(parent)
        try:
            # What we opened is what counts: it may have been swapped since the lstat.
            info = os.fstat(fd)
            self._check_readable(path, info)
        except BaseException:
            os.close(fd)
            raise
        return fd, info.st_size

    def snapshot(self, max_entries: int = MAX_WALK_ENTRIES) -> Snapshot:
        """Size and mtime of every regular file, for `changed`.

        Args:
            max_entries: Directory entries to look at, at most; files beyond are unseen.

        Returns:
            Relative path -> (size in bytes, mtime in ns).
        """
        found, _ = self._walk(max_entries)
        return {path: (info.st_size, info.st_mtime_ns) for path, info in found}

    def list(self, max_entries: int = MAX_WALK_ENTRIES) -> FileListing:
        """Every regular file under the root; symlinks and special files are skipped.

        Symlinked directories are not followed, and names that aren't valid UTF-8
        (which no client could name back) are left out.

        Args:
            max_entries: Directory entries to look at, at most.

        Returns:
            The files sorted by path, and whether the walk stopped early.
        """
        found, truncated = self._walk(max_entries)
        files = tuple(
            FileInfo(path=path, size_bytes=info.st_size, modified=info.st_mtime)
            for path, info in found
        )
        return FileListing(files=files, truncated=truncated)

    def _walk(self, max_entries: int) -> tuple[Found, bool]:
        """Regular files under the root with their lstat, sorted, and whether we stopped early."""
        self.last_walk_entries = max_entries  # until this walk says otherwise
        found, truncated, self.last_walk_entries = walk(self.root, max_entries)
        return found, truncated

    def _open_directory(self, path: str, directories: Sequence[str], *, create: bool) -> int:
        """An fd on root/directories, walked one component at a time, following no symlink."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in directories:
                child = self._open_child(fd, name, path, create=create)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_child(self, parent: int, name: str, path: str, *, create: bool) -> int:
        """An fd on the directory name in parent, made (owned by uid:gid) if missing."""
        try:
            return os.open(name, DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise PathNotFound(path) from None
        except OSError as exc:
            _refuse(path, exc, parent, name)
        made = False
        try:
            os.mkdir(name, DIR_MODE, dir_fd=parent)
            made = True
        except FileExistsError:
            pass  # the sandbox made something there meanwhile: open it like any other
        except OSError as exc:
            _refuse(path, exc)
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            _refuse(path, exc, parent, name)
        if made:
            # Through the fd: if the sandbox swapped in its own directory, it is still inside.
            try:
                self._give_to_sandbox(fd, DIR_MODE)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _write_temp(self, parent: int, path: str, data: bytes) -> str:
        """Write data to a new file in parent with an unguessable name; return that name."""
        for _ in range(_TEMP_ATTEMPTS):
            temp = f".cloche-{secrets.token_hex(8)}.tmp"
            try:
                fd = os.open(temp, _CREATE_FLAGS, 0o600, dir_fd=parent)
                break
            except FileExistsError:
                continue  # the sandbox is squatting names; draw another
            except OSError as exc:
                _refuse(path, exc)
        else:
            raise PathRefused(path, "no free temporary name in its directory")
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                self._give_to_sandbox(fd, FILE_MODE)
            finally:
                os.close(fd)
        except OSError as exc:
            _unlink_quietly(parent, temp)
            _refuse(path, exc)
        except BaseException:
            _unlink_quietly(parent, temp)
            raise
        return temp

    def _give_to_sandbox(self, fd: int, mode: int) -> None:
        """chown a file or directory we just made to uid:gid, and set its mode."""
        if self.uid is not None or self.gid is not None:
            os.fchown(
                fd,
                self.uid if self.uid is not None else -1,
                self.gid if self.gid is not None else -1,
            )
        os.fchmod(fd, mode)

    def _check_readable(self, path: str, info: os.stat_result) -> None:
        """Refuse anything but a regular file of at most max_file_bytes."""
        if not stat.S_ISREG(info.st_mode):
            raise PathRefused(path, _describe(info.st_mode))
        if info.st_size > self.max_file_bytes:
            raise PathRefused(path, self._too_large(info.st_size))

    def _read_at_most(self, fd: int, path: str) -> bytes:
        """Read to the end, refusing once past max_file_bytes (the file may be growing)."""
        data = bytearray()
        while len(data) <= self.max_file_bytes:
            chunk = os.read(fd, min(_READ_CHUNK_BYTES, self.max_file_bytes + 1 - len(data)))
            if not chunk:
                return bytes(data)
            data += chunk
        raise PathRefused(
            path, f"it grew past the limit of {self.max_file_bytes} bytes while being read"
        )

    def _too_large(self, size: int) -> str:
        """Why a file of size bytes is refused."""
        return f"it is {size} bytes, over the limit of {self.max_file_bytes} bytes"


class StreamedFile:
    """A file written in pieces into a working directory (a context, an upload of any
    size): to a fresh temporary name in its directory (made if missing, walked following no
    symlink, as `WorkdirFiles.write` does), renamed into place by `finish`. Blocking methods;
    `discard` always, after `finish` or instead of it."""

    def __init__(self, files: WorkdirFiles, name: str) -> None:
        self.files = files
        self.path = normalise(name)
        *self._directories, self.name = self.path.split("/")
        self.size = 0
        self._root = -1  # the file's directory
        self._fd = -1
        self._temp: str | None = None

    def open(self) -> None:
        try:
            self._root = self.files._open_directory(self.path, self._directories, create=True)
        except FileNotFoundError as exc:  # the working directory itself is gone
            raise PathRefused(self.path, "the session's working directory is gone") from exc
        existing = _lstat(self._root, self.name)
        if existing is not None and not stat.S_ISREG(existing.st_mode):  # as `write` refuses
            raise PathRefused(self.path, _describe(existing.st_mode))
        for _ in range(_TEMP_ATTEMPTS):
            temp = f".cloche-{secrets.token_hex(8)}.tmp"
            try:
                self._fd = os.open(temp, _CREATE_FLAGS, 0o600, dir_fd=self._root)
            except FileExistsError:
                continue  # the sandbox is squatting names; draw another
            except OSError as exc:
                raise self._refused(exc) from exc
            self._temp = temp
            return
        raise PathRefused(self.name, "no free temporary name in the working directory")

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.files.max_file_bytes:
            raise PathRefused(
                self.name,
                f"it is over {self.files.max_file_bytes} bytes, the size of the working "
                "directory (--disk-mib)",
            )
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            raise self._refused(exc) from exc

    def finish(self) -> None:
        """Give the file to the sandbox's user and rename it into place."""
        uid, gid = self.files.uid, self.files.gid
        if uid is not None or gid is not None:
            os.fchown(self._fd, uid if uid is not None else -1, gid if gid is not None else -1)
        os.fchmod(self._fd, FILE_MODE)
        os.close(self._fd)
        self._fd = -1
        assert self._temp is not None
        try:
            # rename replaces whatever the sandbox put there (a symlink too): never follows it.
            os.rename(self._temp, self.name, src_dir_fd=self._root, dst_dir_fd=self._root)
        except OSError as exc:
            raise self._refused(exc) from exc
        self._temp = None

    def discard(self) -> None:
        """Close what is open, and remove the temporary file if it is still ours."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._temp is not None:
            try:
                os.unlink(self._temp, dir_fd=self._root)
            except OSError:
                pass
            self._temp = None
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    def _refused(self, exc: OSError) -> PathRefused:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return PathRefused(self.name, "the working directory is full; raise --disk-mib")
        return PathRefused(self.name, f"it can't be written: {exc.strerror}")


def _lstat(parent: int, name: str) -> os.stat_result | None:
    """lstat of name in parent, or None if there is nothing there."""
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _describe(mode: int) -> str:
    """Why a non-regular file is refused."""
    if stat.S_ISLNK(mode):
        return "it is a symlink, which is never followed"
    if stat.S_ISDIR(mode):
        return "it is a directory, not a regular file"
    if stat.S_ISFIFO(mode):
        return "it is a FIFO, not a regular file"
    return "it is a socket or device, not a regular file"


def _refuse(
    path: str, exc: OSError, parent: int | None = None, name: str | None = None
) -> NoReturn:
    """Raise the PathRefused an OSError from the walk stands for, or the OSError itself."""
    refusal = _refusal(path, exc, parent, name)
    if refusal is None:
        raise exc
    raise refusal from exc


def _refusal(path: str, exc: OSError, parent: int | None, name: str | None) -> PathRefused | None:
    """The PathRefused an OSError from the walk stands for, if it stands for one."""
    code = exc.errno
    if code in (errno.ELOOP, errno.ENOTDIR) and parent is not None and name is not None:
        # O_NOFOLLOW | O_DIRECTORY on a symlink gives ENOTDIR, O_NOFOLLOW alone ELOOP.
        found = _lstat(parent, name)
        if found is not None and stat.S_ISLNK(found.st_mode):
            return PathRefused(path, f"{name!r} is a symlink, which is never followed")
        return PathRefused(path, f"{name!r} is not a directory")
    if code in (errno.ELOOP, errno.ENOTDIR):
        return PathRefused(path, "a component on the way is a symlink or not a directory")
    if code == errno.ENOENT:
        return PathRefused(path, "a directory on the way was removed meanwhile")
    if code in (errno.EISDIR, errno.ENOTEMPTY):
        return PathRefused(path, "it is a directory, not a regular file")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return PathRefused(path, "the working directory is full; raise --disk-mib")
    if code == errno.ENAMETOOLONG:
        return PathRefused(path, "it is too long")
    return None


def _unlink_quietly(parent: int, name: str) -> None:
    """Remove our temporary file, if it is still there."""
    try:
        os.unlink(name, dir_fd=parent)
    except OSError:
        pass  # already gone, or the sandbox moved it: nothing of ours to clean
