"""A node whose agent gets no CPU in the middle of a drain, on a local 2-node Ray cluster: its
process is stopped (SIGSTOP) for more than twice the 5 s that once declared such a node dead
(a live agent was, mid-drain, on 2 cores at a load of 16-18), then goes on. It is slow, not
dead: the drain completes, every session of the node moves with its state, the node is never
declared dead, and nothing of its sandboxes is left running once the cluster stops (the
deadline's measurements: benchmarks/results/heartbeats.md)."""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cloche.cluster.manager import ClusterSessionManager
from support import cluster_server, make_config

from .test_cluster_events import ADMIN, USER, client, events, node_ids
from .test_fencing import frozen, node_of, process_gone, run, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]

STARVED_S = 12.0  # without a word from the agent: over twice the old deadline of 5 s
WAIT_S = 600.0


def test_a_node_starved_mid_drain_is_not_taken_for_dead_and_its_drain_completes(
    state_root: Path,
) -> None:
    config = make_config(
        state_root / "starved",
        cluster="local:2",
        tokens=frozenset({"t1"}),
        admin_tokens=frozenset({"boss"}),
        pool_size=1,
    )
    with (
        cluster_server(config) as running,
        client(running, USER) as http,
        client(running, ADMIN) as admin,
        events(http) as stream,
    ):
        made: list[str] = []
        where: dict[str, str] = {}
        while max(Counter(where.values()).values(), default=0) < 3:  # 3 on one node
            assert len(made) < 12, f"sessions did not gather on a node: {where}"
            created = http.post("/v1/sessions")
            assert created.status_code == 201, created.text
            made.append(created.json()["id"])
            assert run(http, made[-1], f"x = {len(made) - 1}").json()["status"] == "ok"
            where[made[-1]] = node_of(stream, made[-1])
        victim = Counter(where.values()).most_common(1)[0][0]
        on_victim = [s for s in made if where[s] == victim]
        pid = node_ids(running)[victim]["pid"]
        assert pid != os.getpid()  # its agent's own process, which this test's cluster made
        manager = running.server.manager
        assert isinstance(manager, ClusterSessionManager)
        link = manager.nodes[victim].link
        assert link is not None

        with ThreadPoolExecutor(1) as pool:
            draining = pool.submit(
                admin.post, f"/v1/cluster/nodes/{victim}/drain", params={"grace_s": WAIT_S}
            )
            wait_for(lambda: node_ids(running)[victim]["state"] == "draining", "the drain", WAIT_S)
            with frozen(pid):  # starved: no CPU at all, until the front end has waited long
                wait_for(
                    lambda: time.monotonic() - link.heard_at > STARVED_S,
                    f"{STARVED_S:g} s without a word from the starved agent",
                    WAIT_S,
                )
            drained = draining.result(WAIT_S)
        assert drained.status_code == 200, drained.text
        report = drained.json()
        assert report["failed"] == [] and report["moved"] == len(on_victim), report
        assert node_ids(running)[victim]["state"] == "draining"  # never declared dead
        for session_id in made:  # each with its state, wherever it is now
            ran = run(http, session_id, "x")
            assert ran.status_code == 200, ran.text
            assert ran.json()["result_json"] == made.index(session_id)
            assert http.delete(f"/v1/sessions/{session_id}").status_code == 204
    # The cluster stopped (and found no node directory left): nothing of the node runs.
    assert process_gone(pid)
    found = subprocess.run(["pgrep", "-af", str(config.state_dir)], capture_output=True, text=True)
    assert [line for line in found.stdout.splitlines() if "pgrep" not in line] == []
    with open("/proc/self/mountinfo") as mountinfo:
        assert [line for line in mountinfo if str(config.state_dir) in line] == []
