"""Moving a process behind for the CPU (sandbox/cgroups/), on the host's real cgroups, v1
or v2, with a process of the test's own in place of a sandbox."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloche.sandbox import cgroups

V2 = cgroups.host().version == 2
MEMORY_LIMIT = 64 * 1024 * 1024  # the sandbox's backstop here: bytes
# For each line N, holds N MiB more, faulted in, and says so.
HOG = (
    "import sys\nheld = []\nfor line in sys.stdin:\n"
    "    held.append(b'x' * (int(line) << 20))\n    print('held', flush=True)"
)


def groups_of(pid: int) -> dict[str, str]:
    """Controller(s) -> cgroup of a process, as /proc/<pid>/cgroup lists them ("" for v2)."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().split()
    return dict(line.split(":", 2)[1:] for line in lines)


def directory(path: str, controller: str = "cpu") -> Path:
    """A group's directory: in the v1 hierarchy of controller, or in v2's one."""
    if V2:
        return cgroups.CGROUP_ROOT / path.strip("/")
    root = cgroups.cpu_only_hierarchy() if controller == "cpu" else cgroups.CGROUP_ROOT / "memory"
    assert root is not None
    return root / path.strip("/")


@pytest.fixture
def sandbox() -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    """A process in a cgroup of its own with a CPU quota and a memory and pids backstop, as
    a sandbox has (made by runsc on v1, by cloche on v2); and where it would go behind."""
    if os.geteuid() != 0:
        pytest.skip("moving processes between cgroups needs root")
    assert cgroups.can_move_behind(), "v1 with a cpu hierarchy of its own, or v2 with cpu"
    instance, sandbox_id = f"test-{os.getpid()}", uuid.uuid4().hex[:12]
    home = cgroups.cgroups_path(instance, sandbox_id)
    resources = {
        "cpu": {"shares": cgroups.SERVING_CPU_SHARES, "quota": 50_000, "period": 100_000},
        "memory": {"limit": MEMORY_LIMIT},
        "pids": {"limit": 64},
    }
    if V2:
        cgroups.install(home, resources)
    else:
        for controller in ("cpu", "memory"):
            directory(home, controller).mkdir(parents=True)
        (directory(home) / "cpu.cfs_quota_us").write_text("50000\n")
        (directory(home, "memory") / "memory.limit_in_bytes").write_text(f"{MEMORY_LIMIT}\n")
    no_swap = "memory.swap.max" if V2 else "memory.memsw.limit_in_bytes"
    if (directory(home, "memory") / no_swap).exists():  # the backstop, not the disk
        (directory(home, "memory") / no_swap).write_text("0\n" if V2 else f"{MEMORY_LIMIT}\n")
    process = subprocess.Popen(
        [sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    for controller in ("cpu", "memory"):
        (directory(home, controller) / "cgroup.procs").write_text(str(process.pid))
    try:
        yield home, cgroups.behind_path(instance, sandbox_id), process
    finally:
        process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()
        for top in cgroups.tops():
            cgroups.remove(f"{top}/{instance}")
            cgroups.remove_if_empty(top)
        for top in cgroups.tops():
            assert not list(cgroups.CGROUP_ROOT.glob(f"*{top}/{instance}"))


def hold(process: subprocess.Popen[bytes], mib: int) -> bool:
    """Have the process hold mib MiB more; whether it lived to say so."""
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(f"{mib}\n".encode())
    process.stdin.flush()
    return process.stdout.readline() == b"held\n"


def test_a_process_goes_behind_for_the_cpu_and_comes_back_with_its_limits(sandbox):
    home, behind, process = sandbox
    before = groups_of(process.pid)
    assert before.get("cpu", before.get("")) == home

    assert cgroups.put_behind(home, behind)
    after = groups_of(process.pid)
    if V2:  # one group for every controller: the limits came along
        assert after[""] == behind
        for name in ("cpu.max", "memory.max", "pids.max"):
            assert (directory(behind) / name).read_text() == (directory(home) / name).read_text()
        assert (directory(behind) / "cpu.max").read_text() == "50000 100000\n"
        assert (directory(behind) / "memory.max").read_text() == f"{MEMORY_LIMIT}\n"
    else:  # moved for the CPU alone: its memory (and every other) limit stays its own
        assert after["cpu"] == behind
        assert {k: v for k, v in after.items() if k != "cpu"} == {
            k: v for k, v in before.items() if k != "cpu"
        }
        assert (directory(behind) / "cpu.cfs_quota_us").read_text() == "50000\n"
    top = directory(cgroups.tops()[1])
    lowest = ("cpu.idle", "1\n") if (top / "cpu.idle").exists() else ("cpu.weight", "1\n")
    if not V2 and not (top / "cpu.idle").exists():
        lowest = ("cpu.shares", "2\n")
    assert (top / lowest[0]).read_text() == lowest[1]

    cgroups.bring_level(home, behind)
    assert groups_of(process.pid) == before
    assert (directory(behind) / "cgroup.procs").read_text() == ""


def test_behind_the_memory_backstop_still_holds_and_its_oom_kill_is_seen(sandbox):
    """Over its backstop while behind, the process is OOM-killed, and cloche can tell: on
    v2 in the behind group (its new pages are charged there), on v1 in its own."""
    home, behind, process = sandbox
    assert cgroups.put_behind(home, behind)
    assert not hold(process, 256)  # over a backstop of 64 MiB
    assert process.wait(60) == -signal.SIGKILL
    assert cgroups.oom_killed(behind if V2 else home)
    assert not cgroups.oom_killed(home if V2 else behind)


def test_memory_is_what_a_group_holds_now(sandbox):
    """Listings read it on each look (it was read once and kept, so stuck at its first)."""
    home, _, process = sandbox
    first = cgroups.memory_bytes(home)
    assert first is not None
    assert hold(process, 32)
    now = cgroups.memory_bytes(home)
    assert now is not None and now >= first + 30 * 1024 * 1024


def test_moving_a_sandbox_that_has_ended_is_harmless(sandbox):
    home, behind, process = sandbox
    process.kill()
    process.wait()
    assert cgroups.put_behind(home, behind)
    cgroups.bring_level(home, behind)
    cgroups.remove(home)
    cgroups.bring_level(home, behind)  # its home is gone too
    assert not directory(home).exists()


def test_a_home_taken_away_while_empty_is_made_again_on_the_way_back(sandbox):
    """With all its processes behind, a sandbox's cpu cgroup is empty, and another server's
    start (which removes empty cgroups under cloche/) may remove it."""
    home, behind, process = sandbox
    before = groups_of(process.pid)
    assert cgroups.put_behind(home, behind)
    directory(home).rmdir()

    cgroups.bring_level(home, behind)
    assert groups_of(process.pid) == before
    if V2:
        assert (directory(home) / "cpu.max").read_text() == "50000 100000\n"
        assert (directory(home) / "memory.max").read_text() == f"{MEMORY_LIMIT}\n"
    else:
        assert (directory(home) / "cpu.cfs_quota_us").read_text() == "50000\n"
