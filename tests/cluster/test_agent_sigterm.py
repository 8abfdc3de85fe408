"""A node agent given SIGTERM after its node was drained (a pod's preStop, then its end), on
a local 2-node Ray cluster: Ray ends its worker at once, skipping the agent's own stop, so
what its pool's sandboxes had on the host (their tmpfs disks, overlays, runsc state) is
cleaned by the machine's next agent (which waits for that process to end first: see
test_agent_successor.py)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import NOTHING_LEFT, ServerThread, leftovers

from .test_cluster_events import ADMIN, USER, admin_cluster, client, events, node_ids
from .test_fencing import BACK_WITHIN_S, DEAD_WITHIN_S, node_of, process_gone, run, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def cluster(state_root: Path) -> Iterator[ServerThread]:
    with admin_cluster(state_root / "sigterm") as running:
        yield running


def mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as mountinfo:
        return [line.split()[4] for line in mountinfo if line.split()[4].startswith(f"{path}/")]


def runsc_of(path: Path) -> list[str]:
    found = subprocess.run(["pgrep", "-af", f"runsc.*{path}/"], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


def test_an_agent_ended_by_sigterm_after_a_drain_leaves_no_mount_or_runsc(
    cluster: ServerThread,
) -> None:
    state_dir = cluster.config.state_dir
    before = node_ids(cluster)
    with client(cluster, USER) as http, client(cluster, ADMIN) as admin, events(http) as stream:
        session_id = http.post("/v1/sessions").json()["id"]
        assert run(http, session_id, "x = 7").json()["status"] == "ok"
        victim = node_of(stream, session_id)
        pid = before[victim]["pid"]
        assert pid != os.getpid()  # its agent's own process, which this test's cluster made
        (instance,) = [p.name for p in state_dir.glob(f"node-*/{pid}-*") if p.is_dir()]
        instance_dir = next(state_dir.glob(f"node-*/{instance}"))
        drained = admin.post(f"/v1/cluster/nodes/{victim}/drain")
        assert drained.status_code == 200 and drained.json()["moved"] == 1, drained.text
        assert mounts_under(instance_dir) != []  # its pool's sandboxes' disks and overlays
        assert runsc_of(instance_dir) != []

        os.kill(pid, signal.SIGTERM)  # that process alone: its pod is ending
        wait_for(lambda: process_gone(pid), "the agent's process to end", DEAD_WITHIN_S)
        print(f"mounts left as it ended: {len(mounts_under(instance_dir))}")
        wait_for(
            lambda: node_ids(cluster)[victim]["state"] == "dead", "its node dead", DEAD_WITHIN_S
        )
        wait_for(  # the machine's next agent, as it starts, cleans what this one left
            lambda: mounts_under(instance_dir) == [] and runsc_of(instance_dir) == []
            and leftovers(instance_dir.parent, instance) == NOTHING_LEFT,
            "no mount, runsc, cgroup or state of the ended agent",
            BACK_WITHIN_S,
        )  # fmt: skip
        assert run(http, session_id, "x").json()["result_json"] == 7  # moved before: it lives
        assert http.delete(f"/v1/sessions/{session_id}").status_code == 204
