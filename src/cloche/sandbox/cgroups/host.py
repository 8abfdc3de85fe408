"""Where cloche's cgroups go on this host, and making that place ready.

cgroup v1 (or the hybrid layout) has a hierarchy per controller, each mounted under
/sys/fs/cgroup; cloche's groups go at the top of each. cgroup v2 has one hierarchy, and
cloche's groups go under one group of it, the *base*:

- the group systemd delegated to cloche's own unit (`Delegate=yes`, see
  deploy/systemd/cloche.service), found from /proc/self/cgroup: then the sandboxes are in
  the unit's subtree, bounded by its limits and stopped with it;
- else the root of the mount: the host's root cgroup for root on a host, or the
  container's own cgroup in a container with a cgroup namespace of its own (Docker's
  default on v2, and Kubernetes').

v2 lets a group that is not the root hold processes or give controllers to children, not
both. So before the base hands controllers down, its own processes (the server's, and
tini's in a container) move to a leaf of their own, `cloche-server`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from dataclasses import dataclass
from pathlib import Path

from cloche.sandbox import mounts

CGROUP_ROOT = Path("/sys/fs/cgroup")
SERVER_LEAF = "cloche-server"  # v2: the server's own processes, out of the base's way
# systemd marks the group of a unit with Delegate=yes with these (252, Debian 12's, does).
DELEGATE_XATTRS = ("trusted.delegate", "user.delegate")


@dataclass(frozen=True)
class Host:
    """The cgroup layout cloche works in."""

    version: int  # 1: v1 or hybrid (a hierarchy per controller); 2: the unified one alone
    base: str  # v2: the group cloche's groups go under, relative to the mount ("": its root)
    delegated: bool  # the base is the subtree systemd delegated to cloche's unit

    def path(self, *parts: str) -> str:
        """A group's path from the mount's root, as an OCI `cgroupsPath` has it."""
        return "/" + "/".join(p.strip("/") for p in (self.base, *parts) if p.strip("/"))

    @property
    def base_dir(self) -> Path:
        return CGROUP_ROOT / self.base


@functools.cache
def host() -> Host:
    """This host's layout (looked up once: it doesn't change under a server)."""
    if not (CGROUP_ROOT / "cgroup.controllers").is_file():
        return Host(1, "", delegated=False)
    own = own_group()
    if own.rsplit("/", 1)[-1] == SERVER_LEAF:
        own = own.rsplit("/", 1)[0] or "/"  # moved there by prepare(), this or an earlier time
    if own != "/" and is_delegated(CGROUP_ROOT / own.strip("/")):
        return Host(2, own.strip("/"), delegated=True)
    return Host(2, "", delegated=False)


def own_group(pid: int | str = "self") -> str:
    """A process's v2 group ("/" at the root of its cgroup namespace)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            return path or "/"
    return "/"


def is_delegated(group: Path) -> bool:
    for name in DELEGATE_XATTRS:
        try:
            if os.getxattr(group, name).strip(b"\0") == b"1":
                return True
        except OSError:
            continue
    return False


def is_root(group: Path) -> bool:
    """Whether group is the host's root cgroup (the only one without cgroup.type), which
    may hold processes and give controllers to children both."""
    return not (group / "cgroup.type").exists()


def hierarchies() -> list[Path]:
    """Where a group's control files may be: v1's controller mounts, plus the mount itself
    (the unified hierarchy of the hybrid layout); v2's one mount."""
    if host().version == 2:
        return [CGROUP_ROOT]
    return _v1_hierarchies()


@functools.cache
def _v1_hierarchies() -> list[Path]:
    """Looked up once, as the mounts don't change under a server (and a look costs
    ~110 µs, on the event loop when a cell runs past its slice)."""
    roots = [CGROUP_ROOT]
    try:
        roots += [p for p in CGROUP_ROOT.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        pass
    return roots


def writable() -> bool:
    """True when this process may make cgroups where cloche makes them (in every v1
    hierarchy). False in a container whose /sys/fs/cgroup is mounted read-only, Docker's
    default, unless prepare() could remount it."""
    if host().version == 2:
        return os.access(host().base_dir, os.W_OK)
    return all(os.access(root, os.W_OK) for root in hierarchies())


def prepare() -> str:
    """Make cloche's place ready; what it is, or why there is none ("not writable: ...").

    On v2: in a container's own cgroup namespace whose /sys/fs/cgroup is mounted read-only,
    remount it read-write (the kernel keeps the container to its own subtree, and its own
    limits out of reach); move the base's processes to the server's leaf; give the base's
    children every controller the base has (what runsc asks for too).
    """
    layout = host()
    if layout.version == 1:
        if not writable():
            return "not writable: /sys/fs/cgroup is read-only"
        return "cgroup v1, at the top of each hierarchy"
    remounted = _remount_namespace_root()
    if not writable():
        return "not writable: /sys/fs/cgroup is read-only" + (
            "" if own_group() == "/" else " and not this container's own (cgroup namespace)"
        )
    where = f"cgroup v2, under {layout.base_dir}" + (
        " (delegated to this unit)" if layout.delegated else ""
    )
    if remounted:
        where += " (remounted read-write: this container's cgroup namespace)"
    if is_root(layout.base_dir):
        return where
    leaf = layout.base_dir / SERVER_LEAF
    try:
        for _ in range(5):  # a process forked during a pass is in the next one
            pids = (layout.base_dir / "cgroup.procs").read_text().split()
            if pids:
                leaf.mkdir(exist_ok=True)
            for pid in pids:
                try:
                    (leaf / "cgroup.procs").write_text(pid)
                except ProcessLookupError:
                    pass  # it exited meanwhile
            if enable_controllers(layout.base_dir):
                return f"{where}; the server moved to {leaf}" if pids else where
    except OSError as exc:
        return f"not writable: {layout.base_dir} ({exc})"
    return f"not writable: {layout.base_dir} keeps processes that can't move to {leaf}"


def enable_controllers(group: Path) -> bool:
    """Give group's children every controller group has; False while group holds processes
    (v2's rule for a group that is not the root)."""
    wanted = (group / "cgroup.controllers").read_text().split()
    enabled = (group / "cgroup.subtree_control").read_text().split()
    if not set(wanted) - set(enabled):
        return True
    control = group / "cgroup.subtree_control"
    try:
        control.write_text(" ".join(f"+{c}" for c in wanted))
    except OSError as exc:
        if exc.errno == errno.EBUSY:  # processes in group
            return False
        for controller in wanted:  # all or none in one write: one by one, what can be
            with contextlib.suppress(OSError):
                control.write_text(f"+{controller}")
    return True


def make_group(path: str) -> Path:
    """v2: make the group at path (from the mount's root, under the base) and the groups
    between, each parent giving its children its controllers; the group's directory."""
    base = host().base_dir
    group = CGROUP_ROOT / path.strip("/")
    parents = [p for p in reversed(group.parents) if p.is_relative_to(base) and p != base]
    for parent in [*parents, group]:
        enable_controllers(parent.parent)
        parent.mkdir(exist_ok=True)
    return group


def _remount_namespace_root() -> bool:
    """Remount /sys/fs/cgroup read-write where it is read-only and shows this process's
    cgroup namespace from its root (a container's own cgroups, not the host's); whether it
    did."""
    if not os.statvfs(CGROUP_ROOT).f_flag & os.ST_RDONLY:
        return False
    if own_group() != "/" or is_root(CGROUP_ROOT) or _mount_root(CGROUP_ROOT) != "/":
        return False  # the host's hierarchy, or an ancestor of this process's group
    try:
        mounts.remount_read_write(CGROUP_ROOT)
    except OSError:
        return False  # no CAP_SYS_ADMIN, or seccomp or AppArmor deny mount
    return True


def _mount_root(point: Path) -> str | None:
    """The root (within its filesystem) of what is mounted on point now."""
    found = None
    try:
        with open("/proc/self/mountinfo") as mountinfo:
            for line in mountinfo:
                fields = line.split()
                if fields[4] == str(point):
                    found = fields[3]  # the last mount on a point is the one seen
    except OSError:
        return None
    return found
