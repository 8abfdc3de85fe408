"""Looking at a server's sandboxes in the host's cgroups, v1 or v2, for the tests of CPU
weights, the behind group and freezing."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloche.sandbox import cgroups

V2 = cgroups.host().version == 2


def group_dir(path: str, controller: str = "cpu") -> Path:
    """A group's directory: in the v1 hierarchy of controller, or in v2's one."""
    if V2:
        return cgroups.CGROUP_ROOT / path.strip("/")
    names = {"cpu": ("cpu", "cpu,cpuacct"), "memory": ("memory",), "freezer": ("freezer",)}
    for name in names[controller]:
        if (cgroups.CGROUP_ROOT / name).is_dir():
            return cgroups.CGROUP_ROOT / name / path.strip("/")
    pytest.skip(f"no cgroup v1 {controller} hierarchy on this machine")


def weight(shares: int) -> int:
    """What a sandbox's group holds for a CPU weight given as v1 shares."""
    return cgroups.weight_of_shares(shares) if V2 else shares


def cpu_weight(path: str) -> int:
    """A group's CPU weight (v1 cpu.shares, or v2 cpu.weight)."""
    return int((group_dir(path) / ("cpu.weight" if V2 else "cpu.shares")).read_text())


def sandbox_weights(instance: str) -> list[int]:
    """The CPU weight of each of a server's sandboxes."""
    found = []
    for group in group_dir(f"{cgroups.tops()[0]}/{instance}").glob("*"):
        try:
            found.append(cpu_weight(str(group.relative_to(group_dir("")))))
        except (OSError, ValueError):
            continue  # not a group, or gone while read (a sandbox that ended meanwhile)
    return found


def sandbox_ids(instance: str) -> list[str]:
    """A server's sandboxes, by their groups."""
    return [g.name for g in group_dir(f"{cgroups.tops()[0]}/{instance}").glob("*") if g.is_dir()]


def behind(instance: str) -> dict[str, list[str]]:
    """The processes of each of a server's sandboxes in the behind group now, by sandbox id
    (a sandbox that came level again keeps an empty group there until it ends)."""
    if not V2:
        assert cgroups.cpu_only_hierarchy() is not None, "no v1 cpu hierarchy of its own"
    found = {}
    for procs in group_dir(f"{cgroups.tops()[1]}/{instance}").glob("*/cgroup.procs"):
        try:
            pids = procs.read_text().split()
        except OSError:
            continue  # removed while read: its sandbox ended
        if pids:
            found[procs.parent.name] = pids
    return found


def sandbox_cpu_s(instance: str, sandbox_id: str) -> float:
    """CPU time a sandbox has used (on v2, time behind is counted in its behind group)."""
    used = cgroups.cpu_usage_s(cgroups.cgroups_path(instance, sandbox_id))
    assert used is not None
    if V2:
        used += cgroups.cpu_usage_s(cgroups.behind_path(instance, sandbox_id)) or 0.0
    return used


def procs(path: str, controller: str = "cpu") -> list[int]:
    return [int(pid) for pid in (group_dir(path, controller) / "cgroup.procs").read_text().split()]


def freezer_state(path: str) -> str:
    """FROZEN, FREEZING or THAWED, as v1's freezer.state says; on v2 from cgroup.freeze (what
    was asked) and cgroup.events (whether every process is frozen)."""
    group = group_dir(path, "freezer")
    if not V2:
        return (group / "freezer.state").read_text().strip()
    if (group / "cgroup.freeze").read_text().strip() != "1":
        return "THAWED"
    events = dict(line.split() for line in (group / "cgroup.events").read_text().splitlines())
    return "FROZEN" if events.get("frozen") == "1" else "FREEZING"


def sandbox_groups(instance: str, sandbox_id: str) -> list[str]:
    """Where a sandbox's processes may be: its own group, and on v2 its behind group (where
    its processes go for every controller, freezing included) once made."""
    groups = [cgroups.cgroups_path(instance, sandbox_id)]
    behind_group = cgroups.behind_path(instance, sandbox_id)
    if V2 and group_dir(behind_group).is_dir():
        groups.append(behind_group)
    return groups


def sandbox_freezer_state(instance: str, sandbox_id: str) -> str:
    """FROZEN when every group of the sandbox is; else FREEZING or THAWED."""
    states = {freezer_state(group) for group in sandbox_groups(instance, sandbox_id)}
    if states == {"FROZEN"}:
        return "FROZEN"
    return "FREEZING" if "FREEZING" in states else "THAWED"


def sandbox_pids(instance: str, sandbox_id: str) -> list[int]:
    """The sandbox's processes, wherever they are."""
    return [
        pid for group in sandbox_groups(instance, sandbox_id) for pid in procs(group, "freezer")
    ]
