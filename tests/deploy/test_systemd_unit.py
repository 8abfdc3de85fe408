"""deploy/systemd/cloche.service: cloche as a systemd service whose cgroup subtree is its own
(`Delegate=yes`). On cgroup v2 the server moves to a leaf group of its own, its sandboxes'
groups are made in the unit's subtree with their limits, and stopping the unit stops cloche
gracefully and leaves nothing."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from cloche.config import MIB, Limits
from cloche.sandbox import cgroups
from cloche.sandbox.cgroups.host import SERVER_LEAF, own_group
from support import NOTHING_LEFT, REPO, ServerProcess, leftovers, require_gvisor

UNIT = REPO / "deploy" / "systemd" / "cloche.service"


def service_settings() -> dict[str, str]:
    """The [Service] section of the shipped unit."""
    section, settings = "", {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif line and not line.startswith("#") and section == "[Service]":
            key, _, value = line.partition("=")
            settings[key] = value
    return settings


def test_the_unit_delegates_its_cgroup_and_lets_cloche_stop_gracefully():
    settings = service_settings()
    assert settings["Delegate"] == "yes"
    assert settings["KillMode"] == "mixed"  # SIGTERM to cloche alone, not to its sandboxes
    assert int(settings["TimeoutStopSec"]) >= 60  # the graceful shutdown's time (compose's)
    assert settings["ExecStart"] == "/opt/cloche/.venv/bin/cloche serve"


def systemctl_show(unit: str, prop: str) -> str:
    done = subprocess.run(
        ["systemctl", "show", "--property", prop, "--value", unit],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.gvisor
@pytest.mark.slow
def test_under_systemd_the_sandboxes_live_in_the_unit_s_own_subtree(tmp_path):
    require_gvisor()
    if Path("/proc/1/comm").read_text().strip() != "systemd" or cgroups.host().version != 2:
        pytest.skip("needs systemd as PID 1 on a cgroup v2 host")
    unit = f"cloche-test-{uuid.uuid4().hex[:8]}"
    skip = ("ExecStart", "EnvironmentFile", "Restart")  # the test's own command, run once
    properties = [f"--property={k}={v}" for k, v in service_settings().items() if k not in skip]
    wrapper = ("systemd-run", f"--unit={unit}", "--pipe", "--wait", "--quiet", "--collect")
    state_dir = tmp_path / "state"
    server = ServerProcess(
        state_dir,
        "--memory-mib",
        "256",
        "--data-pool-size",
        "0",
        wrapper=(*wrapper, *properties, "--"),
    )
    group = ""
    try:
        group = systemctl_show(unit, "ControlGroup")
        assert group.startswith("/system.slice/"), group
        assert own_group(systemctl_show(unit, "MainPID")) == f"{group}/{SERVER_LEAF}"
        placed = [line for line in server.log if "sandbox cgroups:" in line]
        assert placed and f"under /sys/fs/cgroup{group} (delegated" in placed[0], server.log
        with server.client() as client:
            session = client.run("x = 6 * 7")["session_id"]
            assert client.run("x", session)["output"] == "42\n"
        instance_group = cgroups.CGROUP_ROOT / group.strip("/") / "cloche" / server.instance
        sandboxes = [g for g in instance_group.iterdir() if g.is_dir()]
        assert sandboxes, "no sandbox group in the unit's subtree"
        # The session's and the pool's backstop; a probe of the platforms at start-up may
        # still run, with the default limits.
        backstops = {Limits(memory_mib=256).cgroup_memory_mib, Limits().cgroup_memory_mib}
        held = {}
        for sandbox in sandboxes:
            try:
                memory = int((sandbox / "memory.max").read_text()) // MIB
                held[sandbox.name] = (memory, (sandbox / "cgroup.procs").read_text().split())
            except OSError:
                continue  # it ended meanwhile (the probe)
        assert {memory for memory, _ in held.values()} <= backstops, held
        ours = [procs for memory, procs in held.values() if memory == min(backstops)]
        assert len([procs for procs in ours if procs]) >= 2, held  # the session's, the pool's
    finally:
        subprocess.run(["systemctl", "stop", unit], timeout=120, check=False)
        server.process.wait(60)  # systemd-run --wait ends with the unit, with its status
        code = server.stop()
    assert code == 0, server.log[-20:]
    assert server.log[-1].rstrip().endswith("stopped"), server.log[-20:]
    assert not (cgroups.CGROUP_ROOT / group.strip("/")).exists()  # systemd removed it all
    assert leftovers(state_dir, server.instance) == NOTHING_LEFT
