"""A session's system: its template's root filesystem, never written, under a writable
layer of the session's own.

A sandbox's root is an overlay on the host: the template's root filesystem below (shared
by all its sessions, read-only), the session's layer above, in the session's disk — one
tmpfs of `--disk-mib` holding everything the session writes, so that past it a write
fails with ENOSPC inside and nothing else is harmed. The built-in template `python` has no
root filesystem of its own: its root is the server's skeleton (`bundle.build_rootfs`), and
the host's /usr is overlaid at /usr the same way.

The disk (what a checkpoint saves with `archive.pack`, leaving out the overlays' scratch):
    work/     the session's home, bound at /home/user
    site/     its `%pip` packages
    upper/    its layer over /
    usr/      its layer over the host's /usr (template python only)
    .ovl-*/   the overlays' scratch directories, never saved

Mount points inside the root (for the kernel, the home, the door) are made by runsc's own
file server, which resolves every path inside the root: the host never follows a link of
the template or the session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cloche.sandbox import mounts

HOME = "/home/user"
SCRATCH_PREFIX = ".ovl-"  # the overlays' work directories in the disk: not saved


@dataclass(frozen=True)
class System:
    """What a template gives a sandbox: its root filesystem and its defaults."""

    name: str
    rootfs: Path  # below the session's layer at /
    usr: Path | None = None  # a host directory below a second layer at /usr (template python)
    env: tuple[str, ...] = ()  # the image's environment ("K=V")
    shell_path: str = "/bin/sh"
    python: str | None = None  # the image's python3 (>= 3.9), else cloche's is mounted
    user: str = "user"
    uid: int = 1000
    gid: int = 1000
    home: str = HOME
    # Host directories bound read-only into the root, by their path inside.
    binds: tuple[tuple[Path, str], ...] = field(default=())

    @property
    def shell_command(self) -> list[str]:
        """How a command line is run: a login bash, else sh."""
        login = self.shell_path.endswith("bash")
        return [self.shell_path, "-lc" if login else "-c"]


def lay(system: System, disk: Path, root: Path, usr: Path) -> None:
    """Mount the session's root at root (and the /usr layer at usr, for a system with one)
    over the layers in disk, making the layers' directories where they are missing (a
    restored disk has them already)."""
    _overlay(system.rootfs, disk, "upper", root)
    if system.usr is not None:
        _overlay(system.usr, disk, "usr", usr)


def _overlay(lower: Path, disk: Path, name: str, mountpoint: Path) -> None:
    upper = disk / name
    scratch = disk / f"{SCRATCH_PREFIX}{name}"
    upper.mkdir(mode=0o755, exist_ok=True)
    scratch.mkdir(mode=0o700, exist_ok=True)
    mountpoint.mkdir(mode=0o755, exist_ok=True)
    mounts.mount_overlay(mountpoint, lower, upper, scratch)
