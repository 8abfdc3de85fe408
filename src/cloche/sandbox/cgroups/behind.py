"""The behind group: where the processes of a sandbox whose cell runs long go for the CPU,
behind the host's processes (the server and its clients) and the other sandboxes.

A weight set under `cloche/` orders sandboxes among themselves, but the `cloche` group as a
whole competes with the server and its clients at full weight whenever only long cells run
in it. Two sandboxes running long then kept the server and the clients waiting, and the
cells of other sessions took 6-13x as long at the p99 (benchmarks/results/throughput.md).
Only a group beside `cloche` at the lowest priority (`cpu.idle`, else the lowest weight) is
behind them: top-level, or at the top of cloche's delegated subtree (host.py), where it is
behind the server and every sandbox, though not behind the host's other services.

cgroup v1 moves the processes for the CPU alone, in a cpu hierarchy of its own; their
memory and pids limits stay where they are. cgroup v2 moves a process for every controller
at once, so the behind group of a sandbox gets the limits of its home (cpu.max,
memory.max, memory.swap.max, pids.max). Its pids move with it; its memory does not: pages
stay charged to the group they were faulted in, so while behind a sandbox's memory is what
its two groups hold together, and each holds at most the backstop (gVisor's RLIMIT_AS
bounds what the cell allocates either way). Both groups last until the sandbox is
released: memory, CPU time and OOM kills are read from both.
"""

from __future__ import annotations

from pathlib import Path

from cloche.sandbox.cgroups import host as layout

BEHIND = "cloche-behind"
# What a v2 behind group copies from its home (the CPU quota's period comes with cpu.max).
V2_LIMITS = ("cpu.max", "memory.max", "memory.swap.max", "pids.max")
V1_LIMITS = ("cpu.cfs_period_us", "cpu.cfs_quota_us")  # the quota's period first


def cpu_only_hierarchy() -> Path | None:
    """The v1 hierarchy of the cpu controller, when it has no other controller than cpuacct:
    there a process can change its CPU group and keep its memory and pids limits. None
    under v2, where a process has one cgroup for all controllers."""
    for root in layout.hierarchies()[1:]:
        controllers = set(root.name.split(","))
        if "cpu" in controllers and controllers <= {"cpu", "cpuacct"}:
            if (root / "cpu.shares").is_file():
                return root
    return None


def can_move_behind() -> bool:
    """Whether sandboxes can go behind here: v1 with a cpu hierarchy of its own, or v2
    with the cpu controller where cloche makes its groups."""
    if layout.host().version == 2:
        try:
            return "cpu" in (layout.host().base_dir / "cgroup.controllers").read_text().split()
        except OSError:
            return False
    return cpu_only_hierarchy() is not None


def put_behind(home: str, behind: str) -> bool:
    """Move the processes of the cgroup at home to behind (made, with home's limits, under
    the behind group); False where sandboxes can't go behind."""
    root = _root()
    if root is None:
        return False
    target = root / behind.strip("/")
    if not target.is_dir():
        if layout.host().version == 2:
            _lowest_priority(layout.make_group(layout.host().path(BEHIND)))
            layout.make_group(behind)
        else:
            top = root / BEHIND
            top.mkdir(exist_ok=True)
            _lowest_priority(top)
            target.mkdir(parents=True, exist_ok=True)
        _copy_limits(root / home.strip("/"), target)
    _move_processes(root / home.strip("/"), target)
    return True


def bring_level(home: str, behind: str) -> None:
    """Move the processes put behind back to the cgroup at home."""
    root = _root()
    if root is None:
        return
    source, target = root / behind.strip("/"), root / home.strip("/")
    if not target.is_dir() and _read(source / "cgroup.procs").split():
        # With all its processes behind, home was empty, and the start of another server
        # beside this one (which removes empty cgroups under cloche/) took it away.
        if layout.host().version == 2:
            layout.make_group(home)
        else:
            target.mkdir(parents=True, exist_ok=True)
        _copy_limits(source, target)
    _move_processes(source, target)


def _root() -> Path | None:
    if layout.host().version == 2:
        return layout.CGROUP_ROOT if can_move_behind() else None
    return cpu_only_hierarchy()


def _copy_limits(source: Path, target: Path) -> None:
    names = V2_LIMITS if layout.host().version == 2 else V1_LIMITS
    for name in names:
        try:
            (target / name).write_text((source / name).read_text())
        except OSError:
            pass  # the source is gone (its sandbox has ended, and nothing moves), or the
            # kernel has no such control (swap accounting off)


def _lowest_priority(group: Path) -> None:
    """SCHED_IDLE for a whole group (cpu.idle, Linux 5.15): preempted by any other task that
    wakes; the lowest weight where the kernel is older."""
    try:
        (group / "cpu.idle").write_text("1\n")
    except OSError:
        lowest = ("cpu.weight", "1\n") if layout.host().version == 2 else ("cpu.shares", "2\n")
        (group / lowest[0]).write_text(lowest[1])


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


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
