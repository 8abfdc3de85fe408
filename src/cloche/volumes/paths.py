"""Where a session mounts its volumes: what it asks (`{"name", "path", "read_only"}`),
checked once, in one place, before any sandbox is taken.

A path is absolute and canonical (no `.`, `..` or empty component), outside /proc, /dev
and /sys, and neither at, inside nor above a directory the sandbox needs for itself (its
interpreter, its runtime, /usr; the backend names them): a volume there would hide them.
It is not the session's home itself (inside it is fine), nor one of the root's top
directories that the system lives in. Two volumes of a session never share a path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cloche.errors import VolumeRefused
from cloche.volumes.store import check_name

MAX_VOLUMES = 16  # a session mounts at most this many
MAX_PATH_BYTES = 1024
NEVER = ("/proc", "/dev", "/sys")  # gVisor's own: not at, not below
# The system's own top directories: a volume may go below them, not on them.
TOP = frozenset({"/", "/bin", "/boot", "/etc", "/home", "/lib", "/lib64", "/opt", "/run"})
TOP |= frozenset({"/sbin", "/usr", "/var", "/root", "/tmp", "/mnt", "/srv", "/media"})  # noqa: S108


@dataclass(frozen=True)
class VolumeMount:
    """A volume a session mounts: by name, at a path inside, read-only or not."""

    name: str
    path: str
    read_only: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "read_only": self.read_only}


def check_mounts(
    asked: Iterable[Mapping[str, Any]], *, home: str, reserved: Sequence[str] = ()
) -> list[VolumeMount]:
    """What a session asked to mount, checked.

    Args:
        asked: each {"name", "path"?, "read_only"?}; path defaults to /mnt/{name}.
        home: the session's home (a volume may go inside it, not on it).
        reserved: directories the sandbox mounts for itself (`Backend.reserved_paths`).

    Raises:
        VolumeRefused: a bad name or path, a path taken twice, or too many volumes.
    """
    mounts: list[VolumeMount] = []
    for item in asked:
        if not isinstance(item, Mapping) or not set(item) <= {"name", "path", "read_only"}:
            raise VolumeRefused(
                'each volume is {"name": ..., "path": "/absolute/path", "read_only": false}'
            )
        name = check_name(item.get("name"))
        path = check_path(item.get("path") or f"/mnt/{name}", home=home, reserved=reserved)
        read_only = item.get("read_only", False)
        if not isinstance(read_only, bool):
            raise VolumeRefused(f"volume {name!r}: read_only is true or false")
        if any(m.path == path for m in mounts):
            raise VolumeRefused(f"two volumes are asked at {path}: give each its own path")
        mounts.append(VolumeMount(name, path, read_only))
    if len(mounts) > MAX_VOLUMES:
        raise VolumeRefused(f"a session mounts at most {MAX_VOLUMES} volumes, not {len(mounts)}")
    return mounts


def check_path(path: object, *, home: str, reserved: Sequence[str] = ()) -> str:
    """A mount path, canonical. Raises VolumeRefused."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise VolumeRefused(f"a volume's path is absolute (/mnt/data), not {path!r}")
    if "\0" in path or len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise VolumeRefused(f"a volume's path has no NUL and at most {MAX_PATH_BYTES} bytes")
    parts = path.rstrip("/").split("/")[1:]
    if any(part in ("", ".", "..") for part in parts):
        raise VolumeRefused(f"a volume's path has no empty, '.' or '..' component: {path!r}")
    canonical = "/" + "/".join(parts)
    if any(_at_or_below(canonical, top) for top in NEVER):
        raise VolumeRefused(f"{canonical}: a volume can't go at or below /proc, /dev or /sys")
    if canonical in TOP or canonical == home.rstrip("/"):
        raise VolumeRefused(
            f"{canonical}: a volume can't replace a directory of the system or the session's "
            f"home; mount it below one (/mnt/data, {home.rstrip('/')}/data)"
        )
    for own in reserved:
        if _at_or_below(canonical, own) or _at_or_below(own, canonical):
            raise VolumeRefused(
                f"{canonical}: the sandbox mounts {own} for itself; put the volume elsewhere"
            )
    return canonical


def _at_or_below(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")
