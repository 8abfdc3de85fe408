"""The host cgroups runsc makes for sandboxes (under `cloche/<instance>/`), the CPU group
that sandboxes running long are moved to (`cloche-behind/<instance>/`), and removing them."""

from __future__ import annotations

import errno
import functools
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Weights among the sandboxes (under `cloche/`), in these ratios; the lowest is the kernel's
# default, as the scheduler divides a group's weight between the cores it runs on: fifty
# sandboxes at a weight of 16 each were served unevenly (the slowest of fifty downloads
# got 2-4x less than the fastest; at 1024, 1.5-2x).
STARTING_CPU_SHARES = 4096  # while a sandbox starts and waits in the pool
SERVING_CPU_SHARES = 65536  # once a session has it
BACKGROUND_CPU_SHARES = 1024  # while its cell runs past its slice (sessions/gate.py)
# A top-level CPU group, at the lowest priority, for sandboxes whose cells run past their
# slice. Only a top-level group is behind the host's own processes: a weight set under
# `cloche/` orders sandboxes among themselves, but the `cloche` group as a whole competes
# with the server and its clients at full weight whenever only long cells run in it. Two
# sandboxes running long then kept the server and the clients waiting, and the cells of
# other sessions took 6-13x as long at the p99 (benchmarks/results/throughput.md).
BEHIND = "cloche-behind"


def cgroups_path(instance: str, sandbox_id: str) -> str:
    """The OCI `linux.cgroupsPath` for a sandbox."""
    return f"/cloche/{instance}/{sandbox_id}"


def behind_path(instance: str, sandbox_id: str) -> str:
    """A sandbox's place in the top-level behind group."""
    return f"/{BEHIND}/{instance}/{sandbox_id}"


@functools.cache
def _hierarchies() -> list[Path]:
    """cgroup v1 controller mounts, plus the root itself (v2 or the unified hierarchy); looked
    up once, as the mounts don't change under a server (and a look costs ~110 µs, on the
    event loop when a cell runs past its slice)."""
    roots = [CGROUP_ROOT]
    try:
        roots += [p for p in CGROUP_ROOT.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        pass
    return roots


def writable() -> bool:
    """True when this process may make cgroups (in every hierarchy). False in a container
    whose /sys/fs/cgroup is mounted read-only, Docker's default: then runsc must run its
    sandboxes without cgroups, and what only cgroups enforce is not enforced."""
    return all(os.access(root, os.W_OK) for root in _hierarchies())


# What cloche enforces only through cgroups, for the start-up warning when there are none.
CGROUP_ONLY_LIMITS = (
    "memory backstop of each sandbox (--memory-mib stays enforced as RLIMIT_AS)",
    "--cpu-quota",
    "pids backstop (--nproc stays enforced as RLIMIT_NPROC)",
    "CPU priority of sessions over pool refills",
    "--freeze-idle (idle sessions keep their CPU)",
)


def remove(relative: str) -> None:
    """rmdir the cgroup at relative (and its children) in every hierarchy, if empty."""
    relative = relative.strip("/")
    for root in _hierarchies():
        top = root / relative
        if not top.is_dir():
            continue
        for directory, _, _ in sorted(os.walk(top), key=lambda e: len(e[0]), reverse=True):
            try:
                os.rmdir(directory)
            except OSError:
                pass  # still has processes, or already gone


def remove_if_empty(relative: str) -> None:
    """rmdir one cgroup directory in every hierarchy, where it has no children left."""
    for root in _hierarchies():
        try:
            os.rmdir(root / relative.strip("/"))
        except OSError:
            pass


def set_cpu_shares(relative: str, shares: int) -> bool:
    """Give a cgroup a CPU weight (v1 cpu.shares, or v2 cpu.weight); False if it has none."""
    weight = 1 + (max(shares, 2) - 2) * 9999 // 262142  # runc's mapping of shares to weight
    return _write_control(relative, {"cpu.shares": str(shares), "cpu.weight": str(weight)})


def cpu_only_hierarchy() -> Path | None:
    """The v1 hierarchy of the cpu controller, when it has no other controller than cpuacct:
    there a process can change its CPU group and keep its memory and pids limits. None
    under v2, where a process has one cgroup for all controllers."""
    for root in _hierarchies()[1:]:
        controllers = set(root.name.split(","))
        if "cpu" in controllers and controllers <= {"cpu", "cpuacct"}:
            if (root / "cpu.shares").is_file():
                return root
    return None


def put_behind(home: str, behind: str) -> bool:
    """Move the processes of the cgroup at home, for the CPU alone, to behind (made under the
    top-level behind group with home's CPU quota); False where a v1 cpu-only hierarchy is
    missing."""
    root = cpu_only_hierarchy()
    if root is None:
        return False
    target = root / behind.strip("/")
    if not target.is_dir():
        top = root / BEHIND
        top.mkdir(exist_ok=True)
        _lowest_priority(top)
        target.mkdir(parents=True, exist_ok=True)
        _copy_quota(root / home.strip("/"), target)
    _move_processes(root / home.strip("/"), target)
    return True


def bring_level(home: str, behind: str) -> None:
    """Move the processes put behind back to the cgroup at home."""
    root = cpu_only_hierarchy()
    if root is None:
        return
    source, target = root / behind.strip("/"), root / home.strip("/")
    if not target.is_dir() and _read(source / "cgroup.procs").split():
        # With all its processes behind, home was empty, and the start of another server
        # beside this one (which removes empty cgroups under cloche/) took it away.
        target.mkdir(parents=True, exist_ok=True)
        _copy_quota(source, target)
    _move_processes(source, target)


def _copy_quota(source: Path, target: Path) -> None:
    for name in ("cpu.cfs_period_us", "cpu.cfs_quota_us"):  # the quota's period first
        try:
            (target / name).write_text((source / name).read_text())
        except OSError:
            pass  # the source is gone: its sandbox has ended, and nothing moves


def _lowest_priority(group: Path) -> None:
    """SCHED_IDLE for a whole group (cpu.idle, Linux 5.15): preempted by any other task that
    wakes; the lowest weight where the kernel is older."""
    try:
        (group / "cpu.idle").write_text("1\n")
    except OSError:
        (group / "cpu.shares").write_text("2\n")


def _move_processes(source: Path, target: Path) -> None:
    for _ in range(3):  # a process forked during a pass is in the next one
        try:
            pids = (source / "cgroup.procs").read_text().split()
        except OSError:
            return  # the group is gone: its sandbox has ended
        if not pids:
            return
        for pid in pids:
            try:
                (target / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # it exited meanwhile, or the target went with its sandbox


def set_frozen(relative: str, frozen: bool) -> bool:
    """Freeze or thaw every process of a cgroup (v1 freezer.state, or v2 cgroup.freeze);
    False if the machine has no freezer for it."""
    return _write_control(
        relative,
        {
            "freezer.state": "FROZEN" if frozen else "THAWED",
            "cgroup.freeze": "1" if frozen else "0",
        },
    )


# Where each kind of control was last written (hierarchy root, file): tried first, as a
# scan of every hierarchy costs ~200 µs of failed opens, on the event loop.
_written_at: dict[str, tuple[Path, str]] = {}


def _write_control(relative: str, values: dict[str, str]) -> bool:
    """Write the first of the control files (name -> value) this cgroup has, in whichever
    hierarchy has it; False if none does."""
    relative = relative.strip("/")
    kind = next(iter(values))
    last = _written_at.get(kind)
    if last is not None:
        root, name = last
        try:
            (root / relative / name).write_text(f"{values[name]}\n")
            return True
        except OSError:
            pass
    for root in _hierarchies():
        for name, value in values.items():
            try:
                (root / relative / name).write_text(f"{value}\n")
            except OSError:
                continue
            _written_at[kind] = (root, name)
            return True
    return False


def cpu_usage_s(relative: str) -> float | None:
    """CPU time a cgroup's processes have used, in seconds (v1 cpuacct.usage, or v2
    cpu.stat); None if the machine doesn't account it. One read of one file: it is read on
    the event loop each time a cell runs past its slice."""
    where = _usage_file()
    if where is None:
        return None
    root, name = where
    try:
        text = (root / relative.strip("/") / name).read_text()
    except OSError:
        return None
    if name == "cpuacct.usage":
        return int(text) / 1e9
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "usage_usec":
            return int(value) / 1e6
    return None


@functools.cache
def memory_bytes(relative: str) -> int | None:
    """Memory a cgroup's processes hold now, in bytes (v1 memory.usage_in_bytes, or v2
    memory.current); None if the machine doesn't account it."""
    for path in (
        CGROUP_ROOT / "memory" / relative.strip("/") / "memory.usage_in_bytes",
        CGROUP_ROOT / relative.strip("/") / "memory.current",
    ):
        text = _read(path).strip()
        if text.isdigit():
            return int(text)
    return None


def _usage_file() -> tuple[Path, str] | None:
    """The hierarchy root that counts CPU usage and the file that has it in each cgroup
    (looked up once: the mounts don't change under a server)."""
    for root in _hierarchies():
        if (root / "cpuacct.usage").is_file():
            return root, "cpuacct.usage"
    if "usage_usec" in _read(CGROUP_ROOT / "cpu.stat"):
        return CGROUP_ROOT, "cpu.stat"
    return None


def oom_killed(relative: str) -> bool:
    """Whether the kernel's OOM killer killed a process of a cgroup for going over its
    memory limit. Its own counter (v1 memory.oom_control's oom_kill, v2 memory.events')
    says so while the cgroup is there; runsc removes it as the sandbox exits, usually
    before anyone asks, so then the kernel's log says it (its line names the cgroup). False
    when neither can be read (a container without /dev/kmsg)."""
    for root, name in (
        (CGROUP_ROOT / "memory", "memory.oom_control"),
        (CGROUP_ROOT, "memory.events"),
    ):
        for line in _read(root / relative.strip("/") / name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                return True
    return f"oom_memcg={relative.rstrip('/')}," in _kernel_log()


def _kernel_log() -> str:
    """The kernel's log as /dev/kmsg holds it now (blocking; root only); "" if unreadable."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    records = []
    try:
        while True:
            try:
                records.append(os.read(fd, 8192))
            except BlockingIOError:
                break  # read to the end
            except OSError as exc:  # EPIPE: a record was overwritten while reading; go on
                if exc.errno != errno.EPIPE:
                    break
    finally:
        os.close(fd)
    return b"".join(records).decode(errors="replace")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def thaw_all(relative: str) -> None:
    """Thaw a cgroup and every cgroup below it (frozen processes can't even be killed)."""
    relative = relative.strip("/")
    for root in _hierarchies():
        top = root / relative
        if top.is_dir():
            for directory, _, _ in os.walk(top):
                set_frozen(str(Path(directory).relative_to(root)), False)
