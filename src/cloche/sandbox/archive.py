"""A session's disk saved beside its checkpoint, and laid out again for a restore.

The image holds the sandbox's memory; what the session wrote is on a host tmpfs (its home,
its packages, its layer over the template: see `layers`), saved here as a tar. The layer
is an overlay's upper directory: files keep their owners and modes (a file root installed
stays root's), deletions are whiteouts (character devices 0:0) and a directory made anew
over the template's is marked opaque (an extended attribute, kept in the tar's PAX
header). Its content is the sandbox's: unpacking refuses anything that would land outside
the destination, whatever the archive says, and any other device.
"""

from __future__ import annotations

import copy
import os
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path

_OPAQUE = "trusted.overlay.opaque"
# tarfile's extraction filters (3.11.4+; Debian bookworm's 3.11.2 has none): each entry is
# checked here first, then extracted as it is.
_FILTERS = hasattr(tarfile, "fully_trusted_filter")
_PAX_OPAQUE = f"SCHILY.xattr.{_OPAQUE}"


def pack(directory: Path, archive: Path, *, leave_out: Callable[[str], bool] | None = None) -> int:
    """Save directory's content (not itself) into archive, a plain tar; its size in bytes.

    Symlinks are kept as links (they mean something only inside the sandbox); sockets are
    left out, and so are the top-level entries leave_out names.
    """

    def with_opaque(info: tarfile.TarInfo) -> tarfile.TarInfo:
        if info.isdir():
            try:
                value = os.getxattr(directory / info.name, _OPAQUE, follow_symlinks=False)
            except OSError:
                return info
            info.pax_headers = {**info.pax_headers, _PAX_OPAQUE: value.decode("latin-1")}
        return info

    fd = os.open(archive, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with (
        os.fdopen(fd, "wb") as out,
        tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for entry in sorted(os.listdir(directory)):
            if leave_out is None or not leave_out(entry):
                tar.add(directory / entry, arcname=entry, filter=with_opaque)
    return archive.stat().st_size


def unpack(archive: Path, directory: Path) -> None:
    """Lay archive's content into directory as it was saved: owners, modes, whiteouts and
    opaque directories.

    Raises:
        tarfile.TarError: the archive is damaged or an entry would escape directory (or is
            a device other than a whiteout).
    """
    root = os.path.realpath(directory)
    trusted = {"filter": "fully_trusted"} if _FILTERS else {}
    opaque: list[str] = []
    with tarfile.open(archive, mode="r:") as tar:
        for member in tar:
            kept = _confined(member, root)
            tar.extract(kept, root, numeric_owner=True, **trusted)  # type: ignore[arg-type]  # noqa: S202
            if kept.isdir() and _PAX_OPAQUE in member.pax_headers:
                opaque.append(kept.name)
    for name in opaque:
        os.setxattr(os.path.join(root, name), _OPAQUE, b"y", follow_symlinks=False)


def _confined(member: tarfile.TarInfo, root: str) -> tarfile.TarInfo:
    """The entry, checked: its path, through the links already laid out, stays in root;
    a hard link points inside; a device is a whiteout. Symlinks may point anywhere: they
    are followed only inside the sandbox.

    Raises:
        tarfile.TarError: the entry is refused.
    """

    def inside(name: str) -> bool:
        path = os.path.realpath(os.path.join(root, name.lstrip("/")))
        return os.path.commonpath([root, path]) == root

    if not inside(member.name) or (member.islnk() and not inside(member.linkname)):
        raise tarfile.TarError(f"{member.name!r} would land outside {root}")
    if member.isblk() or (member.ischr() and (member.devmajor, member.devminor) != (0, 0)):
        raise tarfile.TarError(f"{member.name!r} is a device")
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        if not (member.isfifo() or member.ischr()):
            raise tarfile.TarError(f"{member.name!r} is of an unknown kind")
    kept = copy.copy(member)
    kept.name = member.name.lstrip("/")
    if member.islnk():
        kept.linkname = member.linkname.lstrip("/")
    kept.mode = stat.S_IMODE(member.mode)
    return kept
