"""A wheel's files into a session's site directory: only regular files, only inside it.

A wheel is a zip archive, made by whoever published the package. Every entry is checked
before anything is written: a name that is absolute, holds `..` or a backslash, or an
entry that is a symlink or any other special file refuses the whole wheel (zip-slip). The
files are then written through `WorkdirFiles`, which follows no symlink the sandbox may
have put in the site directory meanwhile. Nothing of the wheel is run: its `.pth` files and
scripts are only ever read by the sandbox's interpreter.
"""

from __future__ import annotations

import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path

from cloche.errors import PackageInstallError, PathRefused
from cloche.sandbox.files import WorkdirFiles

MAX_ENTRIES = 100_000
# Where the parts of a wheel's `NAME-VERSION.data/` directory go: the libraries into the
# site directory; scripts, headers and data files have no place in a session, and are left.
_DATA_TO_SITE = ("purelib", "platlib")


@dataclass(frozen=True)
class Entry:
    """One file of a wheel and where it goes (relative to the site directory)."""

    info: zipfile.ZipInfo
    target: str


def plan(archive: zipfile.ZipFile, filename: str) -> list[Entry]:
    """The files to write, after checking every entry. Raises PackageInstallError."""
    infos = archive.infolist()
    if len(infos) > MAX_ENTRIES:
        raise PackageInstallError(f"{filename} has more than {MAX_ENTRIES} entries")
    entries = []
    for info in infos:
        name = info.filename
        why = _refusal(info)
        if why is not None:
            raise PackageInstallError(f"{filename} is refused: entry {name[:200]!r} {why}")
        if info.is_dir():
            continue
        target = _target(name)
        if target is not None:
            entries.append(Entry(info, target))
    return entries


def _refusal(info: zipfile.ZipInfo) -> str | None:
    name = info.filename
    if not name or "\0" in name or "\\" in name:
        return "has an invalid name"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "is an absolute path"
    parts = name.rstrip("/").split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "leaves its directory (.., . or an empty component)"
    mode = info.external_attr >> 16
    kind = stat.S_IFMT(mode)
    if kind == stat.S_IFLNK:
        return "is a symbolic link"
    if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
        return "is a special file"
    return None


def _target(name: str) -> str | None:
    parts = name.split("/")
    if len(parts) > 2 and parts[0].endswith(".data"):
        return "/".join(parts[2:]) if parts[1] in _DATA_TO_SITE else None
    return name


def unpacked_bytes(entries: list[Entry]) -> int:
    return sum(entry.info.file_size for entry in entries)


def unpack(path: Path, site: WorkdirFiles) -> tuple[int, list[str]]:
    """Write the wheel at path into site; (bytes written, its top-level .pth files)
    (blocking).

    Raises:
        PackageInstallError: an entry is refused, the archive is broken, or the site
            directory refused a file (a symlink on the way, no room).
    """
    written = 0
    pth: list[str] = []
    try:
        with zipfile.ZipFile(path) as archive:
            for entry in plan(archive, path.name):
                data = archive.read(entry.info)
                site.write(entry.target, data)
                written += len(data)
                if "/" not in entry.target and entry.target.endswith(".pth"):
                    pth.append(entry.target)
    except PathRefused as exc:
        raise PackageInstallError(f"{path.name} could not be unpacked: {exc}") from exc
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:
        raise PackageInstallError(f"{path.name} is not a valid wheel: {exc}") from exc
    return written, pth
