"""Host mounts of sandboxes: a size-limited tmpfs per sandbox, overlays over templates,
read-only views of what sandboxes are given read-only; and making a read-only mount
writable (a container's own cgroups, sandbox/cgroups/host.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_REMOUNT = 32
_MS_BIND = 4096
_MNT_DETACH = 2
# Flags a bind remount must repeat (statvfs's ST_* have mount's MS_* values): nosuid,
# nodev, noexec, noatime, nodiratime, relatime.
_KEPT_FLAGS = 2 | 4 | 8 | 1024 | 2048 | 4096


def mount_tmpfs(path: Path, size_mib: int, uid: int, gid: int) -> None:
    """Mount a tmpfs of size_mib on path, owned by uid:gid, mode 0700."""
    options = f"size={size_mib}m,mode=0700,uid={uid},gid={gid}".encode()
    if _libc.mount(b"tmpfs", bytes(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount tmpfs on {path}: {os.strerror(errno)}")


# The overlay's upper directory must be a plain tree the host can save and lay out again:
# whiteouts and opaque directories only, no index, no redirects, no metadata-only copies.
_OVERLAY_OPTIONS = "redirect_dir=off,index=off,metacopy=off"


def mount_overlay(path: Path, lower: Path, upper: Path, work: Path) -> None:
    """Mount an overlay on path: lower read-only under upper's changes (work: the overlay's
    scratch directory, on upper's file system)."""
    options = f"lowerdir={lower},upperdir={upper},workdir={work},{_OVERLAY_OPTIONS}".encode()
    flags = _MS_NOSUID | _MS_NODEV
    if _libc.mount(b"overlay", bytes(path), b"overlay", flags, options) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount overlay on {path} over {lower}: {os.strerror(errno)}")


def remount_read_write(path: Path) -> None:
    """Make the mount on path writable (a bind remount: its filesystem is left as it is),
    keeping its other flags."""
    flags = _MS_REMOUNT | _MS_BIND | (os.statvfs(path).f_flag & _KEPT_FLAGS)
    if _libc.mount(None, bytes(path), None, flags, None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"remount {path} read-write: {os.strerror(errno)}")


def bind_read_only(source: Path, path: Path) -> None:
    """Bind source on path, read-only on the host itself (no submount of source comes
    along). runsc 0.0~20240729 lets a sandbox truncate a file of a bind mount it was given
    read-only (open with O_TRUNC returns EROFS, or nothing, after truncating on the host):
    given a host mount that is read-only, that truncation fails too."""
    if _libc.mount(bytes(source), bytes(path), None, _MS_BIND, None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"bind {source} on {path}: {os.strerror(errno)}")
    flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
    if _libc.mount(None, bytes(path), None, flags, None) != 0:
        errno = ctypes.get_errno()
        unmount(path)
        raise OSError(errno, f"remount {path} read-only: {os.strerror(errno)}")


class ReadOnlyViews:
    """The host directories sandboxes are given read-only (the kernel's code, the
    interpreter, the runtime), each bound once under root by `bind_read_only`, so that no
    sandbox can truncate them (runsc's own read-only binds let it). Thread-safe; the views
    are unmounted with everything under the server's state directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._views: dict[Path, Path] = {}
        self._lock = threading.Lock()

    def of(self, source: Path) -> Path:
        """The read-only view of source (a directory), made on first use (blocking)."""
        with self._lock:
            view = self._views.get(source)
            if view is None:
                view = self.root / str(len(self._views))
                view.mkdir(mode=0o700, parents=True, exist_ok=True)
                bind_read_only(source, view)
                self._views[source] = view
            return view


def unmount(path: Path) -> None:
    """Detach whatever is mounted on path; nothing if nothing is."""
    if _libc.umount2(bytes(path), _MNT_DETACH) != 0:
        errno = ctypes.get_errno()
        if errno not in (22, 2):  # EINVAL: not a mount point; ENOENT: gone
            raise OSError(errno, f"umount {path}: {os.strerror(errno)}")


def mounts_under(directory: Path) -> list[Path]:
    """Mount points at or below directory, deepest first (from /proc/self/mountinfo)."""
    prefix = str(directory)
    found: list[Path] = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)
