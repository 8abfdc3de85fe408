"""The cluster's directory shrinks with the sessions that expire on their nodes (idle
timeout), as it does with those a front end closes; a metric says its size."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloche.config import Limits
from support import cluster_server, make_config

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def entries(http: httpx.Client) -> float | None:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "cloche_cluster_directory_entries" and sample.labels == {
                "kind": "sessions"
            }:
                return sample.value
    return None


def test_sessions_that_expire_on_a_node_leave_the_directory(state_root: Path) -> None:
    limits = Limits(cell_timeout_s=20.0, interrupt_grace_s=1.0, idle_timeout_s=4.0)
    config = make_config(state_root, cluster="local:2", limits=limits, data_pool_size=0)
    with cluster_server(config) as running:
        manager = running.server.manager
        with httpx.Client(base_url=f"http://127.0.0.1:{running.http_port}", timeout=120) as http:
            ids = []
            for _ in range(4):
                made = http.post("/v1/sessions", json={})
                assert made.status_code == 201, made.text
                ids.append(made.json()["id"])
            kept, expiring = ids[0], ids[1:]
            directory = manager.engine.directory  # type: ignore[union-attr]

            def ask(call: object) -> object:
                async def answer() -> object:
                    return await call  # type: ignore[misc]

                return running.call(answer())

            for session_id in ids:  # all four active now: none expires for 4 s
                ran = http.post(f"/v1/sessions/{session_id}/execute", json={"code": "1"})
                assert ran.status_code == 200, ran.text
            assert ask(directory.size.remote())["sessions"] == 4  # type: ignore[index]
            deadline = time.monotonic() + 120
            seen = []
            while entries(http) != 1.0:  # the kept one runs a cell now and then: it stays
                assert time.monotonic() < deadline, f"the directory kept them: {seen[-5:]}"
                seen.append(entries(http))
                ran = http.post(f"/v1/sessions/{kept}/execute", json={"code": "1"})
                assert ran.status_code == 200, ran.text
                time.sleep(0.5)
            for session_id in expiring:
                assert ask(directory.lookup.remote(session_id)) is None
                assert http.get(f"/v1/sessions/{session_id}").status_code == 404
            assert ask(directory.lookup.remote(kept)) is not None
            assert http.delete(f"/v1/sessions/{kept}").status_code == 204
