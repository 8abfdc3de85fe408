"""A volume's files, reached without a session: listed, read, written in pieces, deleted.

Sessions write a volume's files as they like, symlinks included, and may change them
while the server reads: the same confined walk as a session's working directory is used
(`sandbox.files`): every path walked from a descriptor on the volume's root, one component
at a time, following no symlink; new files written under a temporary name and renamed
into place. A symlink made inside is never followed by the host, whatever it points at.

Blocking throughout: call it from a thread.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from cloche.config import MIB
from cloche.errors import PathNotFound, PathRefused, VolumeFull
from cloche.protocol.paths import normalise
from cloche.sandbox.bundle import USER_GID, USER_UID
from cloche.sandbox.files import StreamedFile, WorkdirFiles


class VolumeFiles(WorkdirFiles):
    """The files under a volume's root (a lease's directory), new ones its user's.

    Args:
        root: what a lease of the volume gave.
        name: the volume's, for messages.
        capacity_bytes: what its files may take in all.
    """

    def __init__(self, root: Path, name: str, capacity_bytes: int) -> None:
        super().__init__(root, USER_UID, USER_GID, capacity_bytes)
        self.name = name

    def delete(self, relative: str) -> None:
        """Remove a file, a symlink (never what it points at) or a directory with all it
        holds (walked by descriptors, following no symlink).

        Raises:
            PathNotFound: nothing is there.
            PathRefused: a bad path, or a component on the way is a symlink.
        """
        path = normalise(relative)
        *directories, name = path.split("/")
        parent = self._open_directory(path, directories, create=False)
        try:
            try:
                found = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                raise PathNotFound(path) from None
            try:
                if stat.S_ISDIR(found.st_mode):
                    # Python's rmtree with dir_fd walks by descriptors and never follows a
                    # symlink, even one swapped in meanwhile.
                    shutil.rmtree(name, dir_fd=parent)
                else:
                    os.unlink(name, dir_fd=parent)
            except FileNotFoundError:
                raise PathNotFound(path) from None
            except OSError as exc:
                raise PathRefused(path, f"it can't be removed: {exc.strerror}") from exc
        finally:
            os.close(parent)

    def streamed(self, relative: str) -> VolumeFile:
        """A file to write in pieces (`StreamedFile`'s steps)."""
        return VolumeFile(self, relative)


class VolumeFile(StreamedFile):
    """A file written in pieces into a volume: refused once it would pass the volume's
    size (VolumeFull); nothing of it is left then."""

    files: VolumeFiles

    def __init__(self, files: VolumeFiles, relative: str) -> None:
        super().__init__(files, relative)
        self.files = files

    def write(self, data: bytes) -> None:
        if self.size + len(data) > self.files.max_file_bytes:
            raise self._full()
        super().write(data)

    def _refused(self, exc: OSError) -> PathRefused:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise self._full() from exc
        return PathRefused(self.path, f"it can't be written: {exc.strerror}")

    def _full(self) -> VolumeFull:
        capacity = self.files.max_file_bytes
        return VolumeFull(
            f"path {self.path!r} refused: volume {self.files.name!r} is full (it holds "
            f"{capacity // MIB} MiB of files at most); delete files, or make a larger volume"
        )
