"""A working directory saved beside a checkpoint image, and laid out again for a restore.

The image holds the sandbox's memory (its /tmp too); the working directory is a host
tmpfs bound into it, so it is saved here as a tar. Its content is the user's: unpacking
refuses anything that would land outside the destination, whatever the archive says.
"""

from __future__ import annotations

import copy
import os
import tarfile
from pathlib import Path


def pack(directory: Path, archive: Path) -> int:
    """Save directory's content (not itself) into archive, a plain tar; its size in bytes.

    Symlinks are kept as links (they mean something only inside the sandbox); sockets are
    left out.
    """
    fd = os.open(archive, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out, tarfile.open(fileobj=out, mode="w") as tar:
        for entry in sorted(os.listdir(directory)):
            tar.add(directory / entry, arcname=entry)
    return archive.stat().st_size


def unpack(archive: Path, directory: Path, uid: int, gid: int) -> None:
    """Lay archive's content into directory, every entry owned by uid:gid.

    Raises:
        tarfile.TarError: the archive is damaged or an entry would escape directory.
    """

    def confine(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
        try:
            kept = tarfile.data_filter(member, dest)
        except (tarfile.AbsoluteLinkError, tarfile.LinkOutsideDestinationError):
            if not member.issym():
                raise
            # A symlink is only followed inside the sandbox, where / is the sandbox's.
            # An entry written through it here is still refused: data_filter resolves
            # every entry's own path.
            kept = member
        except tarfile.SpecialFileError:
            if not member.isfifo():  # a named pipe is harmless; devices are refused
                raise
            kept = tarfile.tar_filter(member, dest)
        return kept.replace(uid=uid, gid=gid, uname="", gname="", deep=False)

    with tarfile.open(archive, mode="r:") as tar:
        if not hasattr(tarfile, "data_filter"):  # Python before 3.11.4 (Debian bookworm's)
            for member in tar:
                tar.extract(_confined(member, directory, uid, gid), directory, numeric_owner=True)  # noqa: S202
            return
        tar.extractall(directory, filter=confine, numeric_owner=True)  # noqa: S202  # confined


def _confined(member: tarfile.TarInfo, dest: Path, uid: int, gid: int) -> tarfile.TarInfo:
    """What tarfile.data_filter checks, for Pythons without it (and without TarInfo.replace):
    the entry's path, through the links already laid out, stays in dest; hard links point
    inside; no devices; no setuid bits. Symlinks may point anywhere: they are followed only
    inside the sandbox.

    Raises:
        tarfile.TarError: the entry is refused.
    """
    root = os.path.realpath(dest)

    def inside(name: str) -> bool:
        path = os.path.realpath(os.path.join(root, name.lstrip("/")))
        return os.path.commonpath([root, path]) == root

    if not inside(member.name) or (member.islnk() and not inside(member.linkname)):
        raise tarfile.TarError(f"{member.name!r} would land outside {dest}")
    if member.ischr() or member.isblk():
        raise tarfile.TarError(f"{member.name!r} is a device")
    kept = copy.copy(member)
    kept.name = member.name.lstrip("/")
    if member.islnk():
        kept.linkname = member.linkname.lstrip("/")
    kept.mode = member.mode & 0o755
    kept.uid, kept.gid, kept.uname, kept.gname = uid, gid, "", ""
    return kept
