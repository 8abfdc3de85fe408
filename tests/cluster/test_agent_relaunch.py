"""A node agent killed -9 on a local 2-node Ray cluster: its node is dead for good, and its
machine gets a new agent (a new node id, nothing on it) without the cluster restarting,
which takes new sessions; the killed agent's sandboxes, mounts and cgroups go as the new
one starts, and its sessions, a paused one too, stay lost (the frozen agent that comes back
is in test_fencing.py)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import NOTHING_LEFT, ServerThread, leftovers

from .test_cluster_events import USER, admin_cluster, client, events, node_ids
from .test_fencing import BACK_WITHIN_S, DEAD_WITHIN_S, answers_lost, node_of, run, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def cluster(state_root: Path) -> Iterator[ServerThread]:
    with admin_cluster(state_root / "relaunch") as running:
        yield running


def test_a_machine_whose_agent_was_killed_gets_a_new_agent_that_serves(
    cluster: ServerThread,
) -> None:
    state_dir = cluster.config.state_dir
    before = node_ids(cluster)
    with client(cluster, USER) as http, events(http) as stream:
        made: list[str] = []
        while len({node_of(stream, s) for s in made}) < 2 or len(made) < 3:
            assert len(made) < 12, "sessions did not spread over both nodes"
            created = http.post("/v1/sessions")
            assert created.status_code == 201, created.text
            made.append(created.json()["id"])
            assert run(http, made[-1], f"x = {len(made) - 1}").json()["status"] == "ok"
        victim = node_of(stream, made[0])
        on_victim = [s for s in made if node_of(stream, s) == victim]
        others = [s for s in made if s not in on_victim]
        if len(on_victim) < 2:  # one more there, to be paused
            while node_of(stream, made[-1]) != victim:
                assert len(made) < 12, "no second session on the victim"
                made.append(http.post("/v1/sessions").json()["id"])
                if node_of(stream, made[-1]) != victim:
                    others.append(made[-1])
            on_victim.append(made[-1])
        paused = on_victim[-1]  # its image on the node's disk
        assert http.post(f"/v1/sessions/{paused}/pause").status_code == 200
        pid = before[victim]["pid"]
        assert pid != os.getpid()  # its agent's own process, which this test's cluster made
        (instance,) = [p.name for p in state_dir.glob(f"node-*/{pid}-*") if p.is_dir()]
        node_state = next(p.parent for p in state_dir.glob(f"node-*/{instance}"))
        assert leftovers(node_state, instance)["mounts"] != []  # its sandboxes' disks

        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)  # that process alone
        wait_for(
            lambda: node_ids(cluster)[victim]["state"] == "dead",
            "the killed node to be declared dead",
            DEAD_WITHIN_S,
        )

        def successor() -> str | None:
            now = node_ids(cluster)
            fresh = [i for i, n in now.items() if i not in before and n["state"] == "alive"]
            return fresh[0] if fresh else None

        wait_for(lambda: successor() is not None, "a new agent on the machine", BACK_WITHIN_S)
        new_id = successor()
        assert new_id is not None
        print(f"a new agent {new_id} {time.monotonic() - killed_at:.1f} s after the kill")
        now = node_ids(cluster)
        assert now[victim]["state"] == "dead" and now[new_id]["pid"] not in (pid, 0)
        assert now[new_id]["sessions"] == 0 and now[new_id]["paused"] == 0  # nothing came back
        assert len(now) == 3
        # What the killed agent left (runsc, mounts, cgroups, state) went as the new one began.
        assert leftovers(node_state, instance) == NOTHING_LEFT

        for session_id in on_victim:  # still lost: the paused one's image did not come back
            answers_lost(http, session_id)
        ran = run(http, others[0], "x")  # the other node's: undisturbed
        assert ran.json()["result_json"] == made.index(others[0]), ran.text
        fresh = http.post("/v1/sessions").json()["id"]  # the emptiest node: the new one
        assert run(http, fresh, "6 * 7").json()["result_json"] == 42
        assert node_of(stream, fresh) == new_id
        for session_id in [*others, fresh]:
            assert http.delete(f"/v1/sessions/{session_id}").status_code == 204
