"""Moving a process behind for the CPU alone (sandbox/cgroups.py), on the host's real
cgroups, with a process of the test's own in place of a sandbox."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloche.sandbox import cgroups


def groups_of(pid: int) -> dict[str, str]:
    """Controller(s) -> cgroup of a process, as /proc/<pid>/cgroup lists them."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().split()
    return dict(line.split(":", 2)[1:] for line in lines)


@pytest.fixture
def cpu_root() -> Path:
    if os.geteuid() != 0:
        pytest.skip("moving processes between cgroups needs root")
    root = cgroups.cpu_only_hierarchy()
    assert root is not None, "this machine's cgroups are v1 with a cpu hierarchy of its own"
    return root


@pytest.fixture
def sandbox(cpu_root: Path) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    """A process in a cgroup of its own in the cpu and memory hierarchies, with a CPU
    quota, as runsc makes one for a sandbox; and where it would go behind."""
    instance, sandbox_id = f"test-{os.getpid()}", uuid.uuid4().hex[:12]
    home = cgroups.cgroups_path(instance, sandbox_id)
    memory = cgroups.CGROUP_ROOT / "memory" / home.strip("/")
    for directory in (cpu_root / home.strip("/"), memory):
        directory.mkdir(parents=True)
    (cpu_root / home.strip("/") / "cpu.cfs_quota_us").write_text("50000\n")
    process = subprocess.Popen(["sleep", "600"])
    for directory in (cpu_root / home.strip("/"), memory):
        (directory / "cgroup.procs").write_text(str(process.pid))
    try:
        yield home, cgroups.behind_path(instance, sandbox_id), process
    finally:
        process.kill()
        process.wait()
        for top in ("cloche", cgroups.BEHIND):
            cgroups.remove(f"{top}/{instance}")
            cgroups.remove_if_empty(top)
        assert not list(cgroups.CGROUP_ROOT.glob(f"*/*/{instance}"))


def test_a_process_goes_behind_for_the_cpu_alone_and_comes_back(cpu_root, sandbox):
    home, behind, process = sandbox
    before = groups_of(process.pid)
    assert before["cpu"] == home and before["memory"] == home

    assert cgroups.put_behind(home, behind)
    after = groups_of(process.pid)
    assert after["cpu"] == behind
    assert {k: v for k, v in after.items() if k != "cpu"} == {
        k: v for k, v in before.items() if k != "cpu"
    }  # its memory (and every other) limit stays its own
    assert (cpu_root / behind.strip("/") / "cpu.cfs_quota_us").read_text() == "50000\n"
    top = cpu_root / cgroups.BEHIND
    idle = top / "cpu.idle"
    assert (
        (idle.read_text() == "1\n") if idle.exists() else (top / "cpu.shares").read_text() == "2\n"
    )

    cgroups.bring_level(home, behind)
    assert groups_of(process.pid) == before
    assert (cpu_root / behind.strip("/") / "cgroup.procs").read_text() == ""


def test_moving_a_sandbox_that_has_ended_is_harmless(cpu_root, sandbox):
    home, behind, process = sandbox
    process.kill()
    process.wait()
    assert cgroups.put_behind(home, behind)
    cgroups.bring_level(home, behind)
    cgroups.remove(home)
    cgroups.bring_level(home, behind)  # its home is gone too
    assert not (cpu_root / home.strip("/")).exists()


def test_a_home_taken_away_while_empty_is_made_again_on_the_way_back(cpu_root, sandbox):
    """With all its processes behind, a sandbox's cpu cgroup is empty, and another server's
    start (which removes empty cgroups under cloche/) may remove it."""
    home, behind, process = sandbox
    before = groups_of(process.pid)
    assert cgroups.put_behind(home, behind)
    (cpu_root / home.strip("/")).rmdir()

    cgroups.bring_level(home, behind)
    assert groups_of(process.pid) == before
    assert (cpu_root / home.strip("/") / "cpu.cfs_quota_us").read_text() == "50000\n"
