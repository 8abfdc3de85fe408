"""The host cgroups of sandboxes (`cloche/<instance>/<sandbox>`), the CPU group that
sandboxes running long are moved to (`cloche-behind/<instance>/<sandbox>`, behind.py), and
removing them; on cgroup v1 and v2 alike, at the top of each v1 hierarchy or under the v2
group that host.py finds.

runsc makes a sandbox's group from its bundle's `linux.resources` on v1. On v2 cloche makes
it, with the same limits (install): runsc then leaves it when the sandbox ends, and the
kernel's count of OOM kills in it (memory.events) can still be read to tell why the
sandbox died, where the kernel's log can't be (a container has no /dev/kmsg).
"""

from __future__ import annotations

import errno
import functools
import os
import time
from pathlib import Path
from typing import Any

from cloche.sandbox.cgroups.behind import (
    BEHIND,
    bring_level,
    can_move_behind,
    cpu_only_hierarchy,
    put_behind,
)
from cloche.sandbox.cgroups.host import (
    CGROUP_ROOT,
    hierarchies,
    host,
    make_group,
    prepare,
    writable,
)

__all__ = [
    "BACKGROUND_CPU_SHARES",
    "BEHIND",
    "CGROUP_ONLY_LIMITS",
    "CGROUP_ROOT",
    "SANDBOXES",
    "SERVING_CPU_SHARES",
    "STARTING_CPU_SHARES",
    "behind_path",
    "bring_level",
    "can_move_behind",
    "cgroups_path",
    "cpu_only_hierarchy",
    "cpu_usage_s",
    "host",
    "install",
    "memory_bytes",
    "oom_killed",
    "prepare",
    "put_behind",
    "remove",
    "remove_if_empty",
    "set_cpu_shares",
    "set_frozen",
    "thaw_all",
    "tops",
    "weight_of_shares",
    "writable",
]

SANDBOXES = "cloche"
# Weights among the sandboxes (under `cloche/`), in these ratios; the lowest is v1's default
# (cgroup v2 gets runsc's translation of each, 39, 157 and 2500 of 10000: the same ratios),
# as the scheduler divides a group's weight between the cores it runs on: fifty sandboxes
# at a weight of 16 each were served unevenly (the slowest of fifty downloads got 2-4x less
# than the fastest; at 1024, 1.5-2x).
STARTING_CPU_SHARES = 4096  # while a sandbox starts and waits in the pool
SERVING_CPU_SHARES = 65536  # once a session has it
BACKGROUND_CPU_SHARES = 1024  # while its cell runs past its slice (sessions/gate.py)


def cgroups_path(instance: str, sandbox_id: str) -> str:
    """The OCI `linux.cgroupsPath` for a sandbox."""
    return host().path(SANDBOXES, instance, sandbox_id)


def behind_path(instance: str, sandbox_id: str) -> str:
    """A sandbox's place in the behind group."""
    return host().path(BEHIND, instance, sandbox_id)


def tops() -> tuple[str, str]:
    """The groups of every server's sandboxes, and of those behind (paths from the mount)."""
    return host().path(SANDBOXES), host().path(BEHIND)


# What cloche enforces only through cgroups, for the start-up warning when there are none.
CGROUP_ONLY_LIMITS = (
    "memory backstop of each sandbox (--memory-mib stays enforced as RLIMIT_AS)",
    "--cpu-quota",
    "pids backstop (--nproc stays enforced as RLIMIT_NPROC)",
    "CPU priority of sessions over pool refills",
    "--freeze-idle (idle sessions keep their CPU)",
)


def weight_of_shares(shares: int) -> int:
    """v2's cpu.weight for v1's cpu.shares: runc's mapping, which runsc applies too."""
    return 1 + (max(shares, 2) - 2) * 9999 // 262142


def install(path: str, resources: dict[str, Any]) -> None:
    """On v2, make a sandbox's group at path with the limits of its bundle's
    `linux.resources` (memory, pids, CPU weight and quota), as runsc would; nothing on v1,
    where runsc does it. A group that could not be made whole is removed, for runsc to
    make."""
    if host().version != 2:
        return
    values: dict[str, str] = {}
    cpu = resources.get("cpu", {})
    if cpu.get("shares"):
        values["cpu.weight"] = str(weight_of_shares(int(cpu["shares"])))
    if cpu.get("quota"):
        values["cpu.max"] = f"{cpu['quota']} {cpu.get('period') or 100_000}"
    if resources.get("memory", {}).get("limit"):
        values["memory.max"] = str(resources["memory"]["limit"])
    if resources.get("pids", {}).get("limit"):
        values["pids.max"] = str(resources["pids"]["limit"])
    group = make_group(path)
    try:
        for name, value in values.items():
            (group / name).write_text(value)
    except OSError:
        remove(path)
        raise


def remove(relative: str, wait_s: float = 0.0) -> None:
    """rmdir the cgroup at relative (and its children) in every hierarchy, if empty;
    wait_s: how long processes still ending (just killed) may take to leave it (blocking,
    looked at every 50 ms: a v1 cgroup tells nobody when it empties)."""
    relative = relative.strip("/")
    deadline = time.monotonic() + wait_s
    while _remove_once(relative) and time.monotonic() < deadline:
        time.sleep(0.05)


def _remove_once(relative: str) -> bool:
    """One try of `remove`; whether some of it is left."""
    left = False
    for root in hierarchies():
        top = root / relative
        if not top.is_dir():
            continue
        for directory, _, _ in sorted(os.walk(top), key=lambda e: len(e[0]), reverse=True):
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass  # already gone
            except OSError:
                left = True  # still has processes
    return left


def remove_if_empty(relative: str) -> None:
    """rmdir one cgroup directory in every hierarchy, where it has no children left."""
    for root in hierarchies():
        try:
            os.rmdir(root / relative.strip("/"))
        except OSError:
            pass


def set_cpu_shares(relative: str, shares: int) -> bool:
    """Give a cgroup a CPU weight (v1 cpu.shares, or v2 cpu.weight); False if it has none."""
    return _write_control(
        relative, {"cpu.shares": str(shares), "cpu.weight": str(weight_of_shares(shares))}
    )


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


def thaw_all(relative: str) -> None:
    """Thaw a cgroup and every cgroup below it (frozen processes can't even be killed)."""
    relative = relative.strip("/")
    for root in hierarchies():
        top = root / relative
        if top.is_dir():
            for directory, _, _ in os.walk(top):
                set_frozen(str(Path(directory).relative_to(root)), False)


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
    for root in hierarchies():
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
def _usage_file() -> tuple[Path, str] | None:
    """The hierarchy root that counts CPU usage and the file that has it in each cgroup
    (looked up once: the mounts don't change under a server)."""
    for root in hierarchies():
        if (root / "cpuacct.usage").is_file():
            return root, "cpuacct.usage"
    if "usage_usec" in _read(CGROUP_ROOT / "cpu.stat"):
        return CGROUP_ROOT, "cpu.stat"
    return None


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


def oom_killed(relative: str) -> bool:
    """Whether the kernel's OOM killer killed a process of a cgroup for going over its
    memory limit. Its own counter (v1 memory.oom_control's oom_kill, v2 memory.events')
    says so while the cgroup is there (on v2, until cloche removes it); on v1 runsc removes
    it as the sandbox exits, usually before anyone asks, so then the kernel's log says it
    (its line names the cgroup). False when neither can be read (a container without
    /dev/kmsg)."""
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
