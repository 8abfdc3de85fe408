"""Cluster mode as a user meets it: `cloche serve --cluster local:3`, a second front end on the
same Ray cluster, a drain, a node killed -9, and nothing left when it stops."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloche.client.tcp import TCPClient
from support import ServerProcess, require_cluster

ALPHA, BETA = "alpha-token", "beta-token"
NODES = 3

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def client(server: ServerProcess, token: str = ALPHA) -> httpx.Client:
    return httpx.Client(
        base_url=f"http://127.0.0.1:{server.http_port}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=120,
    )


def run(http: httpx.Client, session_id: str, code: str) -> Any:
    response = http.post(f"/v1/sessions/{session_id}/execute", json={"code": code})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "ok", body
    return body["result_json"]


def new_session(http: httpx.Client, setup: str = "", body: dict[str, Any] | None = None) -> str:
    response = http.post("/v1/sessions", json=body or {})
    assert response.status_code == 201, response.text
    session_id: str = response.json()["id"]
    if setup:
        run(http, session_id, setup)
    return session_id


def nodes(http: httpx.Client) -> dict[str, dict[str, Any]]:
    response = http.get("/v1/cluster")
    assert response.status_code == 200, response.text
    return {node["id"]: node for node in response.json()["nodes"]}


def held(http: httpx.Client) -> int:
    """Sessions the live nodes hold, as their last heartbeats (every 0.5 s) said."""
    alive = [node for node in nodes(http).values() if node["state"] != "dead"]
    return sum(node["sessions"] + node["paused"] for node in alive)


def ray_temp_of(server: ServerProcess) -> str:
    """The Ray temp dir of a local cluster, as its front end logged it."""
    return next(m[1] for line in server.log if (m := re.search(r"temp (\S+)\)", line)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_cluster()
    state = tmp_path_factory.mktemp("cluster-state")
    # ALPHA is an admin's token (the cluster's view and drains are an admin's), BETA a user's.
    server = ServerProcess(
        state, "--cluster", f"local:{NODES}", "--admin-token", ALPHA, "--token", BETA
    )
    ray_temp = ray_temp_of(server)
    with client(server) as http:
        pids = [node["pid"] for node in nodes(http).values()]
    yield server
    assert server.stop() == 0, "".join(server.log[-30:])
    # Nothing of the cluster outlives it: no runsc of any node, no Ray process, no state
    # directory, mount, cgroup or Ray temp directory.
    for pattern in (str(state), ray_temp):
        found = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True)
        assert [p for p in found.stdout.splitlines() if "pgrep" not in p] == [], pattern
    assert not Path(ray_temp).exists()
    assert list(state.iterdir()) == []
    with open("/proc/self/mountinfo") as mountinfo:
        assert [line for line in mountinfo if str(state) in line] == []
    for pid in pids:
        assert list(Path("/sys/fs/cgroup").glob(f"*/cloche/{pid}-*")) == []


def test_sessions_spread_over_the_nodes_and_each_keeps_its_state(cluster) -> None:
    with client(cluster) as http:
        assert len(nodes(http)) == NODES
        assert {n["state"] for n in nodes(http).values()} == {"alive"}

        def make(i: int) -> str:
            return new_session(http, f"x = {i}")

        with ThreadPoolExecutor(6) as pool:
            ids = list(pool.map(make, range(60)))
        wait_for(lambda: held(http) == 60, "every node to report its sessions")
        shares = sorted(node["sessions"] for node in nodes(http).values())
        assert shares[0] >= 15, f"an unfair spread: {shares}"
        for i, session_id in enumerate(ids):
            assert run(http, session_id, "x") == i
        # /metrics has each node's own figures, labelled with its id.
        cells = {
            sample.labels.get("node"): sample.value
            for family in text_string_to_metric_families(http.get("/metrics").text)
            for sample in family.samples
            if sample.name == "cloche_cells_total" and sample.labels.get("status") == "ok"
        }
        assert all(cells.get(node_id, 0) >= 15 for node_id in nodes(http)), cells
        for session_id in ids:
            assert http.delete(f"/v1/sessions/{session_id}").status_code == 204
        wait_for(lambda: held(http) == 0, "the nodes to report them closed")


def test_a_second_front_end_serves_the_same_sessions_and_tokens_hold(cluster) -> None:
    with client(cluster) as first:
        address = first.get("/v1/cluster").json()["ray_address"]
        made_first = new_session(first, "a = 'made on the first'")
        second_state = Path(cluster.state_dir).parent / "second-front-end"
        (ray_token,) = Path(cluster.state_dir).glob("ray-token-*")  # the cluster's own
        second = ServerProcess(
            second_state,
            "--cluster",
            address,
            "--admin-token",
            ALPHA,
            "--token",
            BETA,
            env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ray_token)},
        )
        try:
            with client(second) as other, client(second, BETA) as stranger:
                assert set(nodes(other)) == set(nodes(first))
                assert run(other, made_first, "a") == "made on the first"
                made_second = new_session(other, "b = 'made on the second'")
                assert run(first, made_second, "b") == "made on the second"
                # Another token's sessions are not found, through either front end.
                assert stranger.get(f"/v1/sessions/{made_first}").status_code == 404
                assert (
                    stranger.post(
                        f"/v1/sessions/{made_second}/execute", json={"code": "b"}
                    ).status_code
                    == 404
                )
                assert [s["id"] for s in stranger.get("/v1/sessions").json()["sessions"]] == []
                listed = {s["id"] for s in other.get("/v1/sessions").json()["sessions"]}
                assert {made_first, made_second} <= listed
        finally:
            assert second.stop() == 0, "".join(second.log[-30:])
        # A replica's end loses nothing: the agents and their sessions go on.
        assert run(first, made_first, "a") == "made on the first"
        assert run(first, made_second, "b") == "made on the second"
        with TCPClient("127.0.0.1", cluster.tcp_port) as tcp:
            reply = tcp.request({"session_id": made_second, "code": "b", "token": ALPHA})
            assert reply["status"] == "ok", reply
            assert reply["output"] == "'made on the second'\n"
        for session_id in (made_first, made_second):
            assert first.delete(f"/v1/sessions/{session_id}").status_code == 204


def test_a_drained_node_s_sessions_go_on_elsewhere_with_their_state(cluster) -> None:
    with client(cluster) as http:
        setup = "x = {i}\ng = iter(range(100))\nnext(g)\nopen('f.txt', 'w').write('file {i}')"
        ids = [
            new_session(http, setup.format(i=i), body={"metadata": {"i": str(i)}}) for i in range(9)
        ]
        snapshots = {}
        for i, session_id in enumerate(ids):
            response = http.post(f"/v1/sessions/{session_id}/snapshot", json={})
            assert response.status_code == 201, response.text
            snapshots[i] = response.json()["id"]
        wait_for(lambda: held(http) == 9, "every node to report its sessions")
        busiest = max(nodes(http).values(), key=lambda node: node["sessions"])
        assert busiest["sessions"] >= 3

        response = http.post(f"/v1/cluster/nodes/{busiest['id']}/drain")
        assert response.status_code == 200, response.text
        drained = response.json()
        assert drained["moved"] == busiest["sessions"] and drained["failed"] == []
        assert drained["snapshots"] >= 1

        for i, session_id in enumerate(ids):  # its history and metadata came along
            cells = http.get(f"/v1/sessions/{session_id}/cells").json()["cells"]
            assert [cell["code"] for cell in cells] == [setup.format(i=i)]
            assert http.get(f"/v1/sessions/{session_id}").json()["metadata"] == {"i": str(i)}
        for i, session_id in enumerate(ids):  # same id, same state, wherever it is now
            assert run(http, session_id, "[x, next(g), open('f.txt').read()]") == [
                i,
                1,
                f"file {i}",
            ]
        wait_for(
            lambda: nodes(http)[busiest["id"]]["sessions"] == 0, "the drained node to be empty"
        )
        assert nodes(http)[busiest["id"]]["state"] == "draining"
        fresh = [new_session(http) for _ in range(3)]  # none goes to the draining node
        assert nodes(http)[busiest["id"]]["sessions"] == 0
        # Every snapshot restores, those of the drained node on another node.
        for i, snapshot_id in snapshots.items():
            restored = new_session(http, body={"snapshot": snapshot_id})
            assert run(http, restored, "[x, next(g)]") == [i, 1]
            fresh.append(restored)
        for session_id in ids + fresh:
            assert http.delete(f"/v1/sessions/{session_id}").status_code == 204
        unknown = http.post("/v1/cluster/nodes/no-such-node/drain")
        assert unknown.status_code == 404


def test_a_killed_node_s_sessions_are_lost_and_the_others_go_on(cluster) -> None:
    with client(cluster) as http:
        ids = [new_session(http, f"x = {i}") for i in range(8)]
        alive = lambda: [n for n in nodes(http).values() if n["state"] == "alive"]  # noqa: E731
        wait_for(lambda: held(http) == 8, "every node to report its sessions")
        victim = max(alive(), key=lambda node: node["sessions"])
        assert victim["sessions"] >= 1 and len(alive()) >= 2

        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        answers: dict[str, Any] = {}
        for i, session_id in enumerate(ids):  # each answers at once: no hang, no "not found"
            response = http.post(f"/v1/sessions/{session_id}/execute", json={"code": "x"})
            answers[session_id] = response
            if response.status_code == 200:
                assert response.json()["result_json"] == i
            else:
                assert response.status_code == 410, response.text
                assert response.json()["error"]["message"] == (
                    f"Session {session_id} was lost: its node failed"
                )
        lost = [s for s, r in answers.items() if r.status_code == 410]
        print(f"lost answered {time.monotonic() - killed_at:.2f} s after the kill")
        assert len(lost) == victim["sessions"]
        with TCPClient("127.0.0.1", cluster.tcp_port) as tcp:
            reply = tcp.request({"session_id": lost[0], "code": "x", "token": ALPHA})
            assert reply["status"] == "error"
            assert reply["error"] == f"Session {lost[0]} was lost: its node failed"
        wait_for(lambda: nodes(http)[victim["id"]]["state"] == "dead", "the node to be dead")
        after = new_session(http, "y = 7")  # new sessions start, elsewhere
        assert run(http, after, "y") == 7
        for session_id in [s for s in ids if s not in lost] + [after]:
            assert http.delete(f"/v1/sessions/{session_id}").status_code == 204
        metrics = http.get("/metrics").text
        assert f'cloche_cluster_node_up{{node="{victim["id"]}",state="dead"}} 0.0' in metrics


def test_a_node_given_sigterm_answers_lost_never_killed_or_not_found(cluster) -> None:
    """Cells in flight on every session while one agent gets SIGTERM (its pod terminated):
    its sandboxes die with it, and its sessions answer "lost", not "killed by SIGKILL ...
    memory" nor "not found" (both were seen, in one run of three, before the agent watched
    for SIGTERM); the other node's sessions go on."""
    with client(cluster) as http:
        drained = next(n for n in nodes(http).values() if n["state"] == "draining")
        back = http.post(f"/v1/cluster/nodes/{drained['id']}/resume")
        assert back.status_code == 200, back.text
        assert back.json() == {"node": drained["id"], "state": "alive"}
        assert http.post("/v1/cluster/nodes/no-such-node/resume").status_code == 404
        alive = [n for n in nodes(http).values() if n["state"] == "alive"]
        assert len(alive) >= 2  # and the killed node's machine, once its new agent is up
        ids = [new_session(http, f"x = {i}") for i in range(8)]
        wait_for(lambda: held(http) == 8, "every node to report its sessions")
        victim = max(nodes(http).values(), key=lambda node: node["sessions"])
        assert 1 <= victim["sessions"] < 8
        stop_at = time.monotonic() + 3600.0
        answers: dict[str, list[tuple[int, str, str]]] = {s: [] for s in ids}

        def loop(session_id: str) -> None:
            with client(cluster) as own:
                while time.monotonic() < stop_at:
                    response = own.post(
                        f"/v1/sessions/{session_id}/execute",
                        json={"code": "import time; time.sleep(0.05); x"},
                    )
                    body = response.json()
                    error = body.get("error") or {}
                    kind = body.get("status") or error.get("type", "")
                    answers[session_id].append((response.status_code, kind, response.text))
                    if response.status_code == 410:
                        return

        with ThreadPoolExecutor(len(ids)) as pool:
            running = [pool.submit(loop, s) for s in ids]
            wait_for(lambda: all(answers[s] for s in ids), "every session to answer once")
            os.kill(victim["pid"], signal.SIGTERM)
            wait_for(lambda: nodes(http)[victim["id"]]["state"] == "dead", "the node to be dead")
            # every session of the victim said lost; give the others a few more cells
            wait_for(
                lambda: sum(1 for s in ids if answers[s][-1][0] == 410) == victim["sessions"],
                "the victim's sessions to answer lost",
            )
            stop_at = time.monotonic() + 1.0
            for future in running:
                future.result()
        for seen in answers.values():
            for status, kind, text in seen:
                assert (status, kind) in {(200, "ok"), (410, "lost")}, text
        lost = [s for s in ids if answers[s][-1][0] == 410]
        assert len(lost) == victim["sessions"]
        for session_id in ids:
            if session_id not in lost:
                assert http.delete(f"/v1/sessions/{session_id}").status_code == 204


def test_the_cluster_view_needs_a_token_and_a_single_server_has_none(cluster) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{cluster.http_port}") as anonymous:
        assert anonymous.get("/v1/cluster").status_code == 401
    with client(cluster, BETA) as user:  # a user's token: the cluster is an admin's business
        assert user.get("/v1/cluster").status_code == 403
        node_id = "no-such-node"
        assert user.post(f"/v1/cluster/nodes/{node_id}/drain").status_code == 403
        assert user.post(f"/v1/cluster/nodes/{node_id}/resume").status_code == 403
    with client(cluster) as http:
        view = json.loads(http.get("/v1/cluster").text)
    assert set(view) == {"ray_address", "nodes"}
    assert set(view["nodes"][0]) == {
        "id",
        "address",
        "state",
        "sessions",
        "paused",
        "pool",
        "memory_available_bytes",
        "pid",
    }


def test_volumes_are_not_offered_over_a_cluster_and_say_why(cluster) -> None:
    with client(cluster, BETA) as http:
        for method, path, body in (
            ("POST", "/v1/volumes", {"name": "data", "size_mib": 4}),
            ("GET", "/v1/volumes", None),
            ("GET", "/v1/volumes/data/files", None),
            ("POST", "/v1/sessions", {"volumes": [{"name": "data"}]}),
        ):
            refused = http.request(method, path, json=body)
            assert refused.status_code == 501, (path, refused.text)
            assert "--cluster" in refused.json()["error"]["message"]
        assert http.get("/v1/sessions").json()["sessions"] == []


def test_the_cli_lists_drains_within_a_grace_and_resumes_nodes(cluster) -> None:
    """`cloche nodes`, as an operator (or a pod's preStop) would run it."""
    cli = Path(sys.executable).parent / "cloche"
    env = {
        **os.environ,
        "CLOCHE_URL": f"http://127.0.0.1:{cluster.http_port}",
        "CLOCHE_TOKEN": ALPHA,
    }

    def cloche(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(cli), "nodes", *argv], capture_output=True, text=True, env=env, timeout=120
        )

    with client(cluster) as http:
        session = new_session(http)
        wait_for(lambda: held(http) >= 1, "a session held by a live node")
        listed = cloche("list", "--json")
        assert listed.returncode == 0, listed.stderr
        alive = [n for n in json.loads(listed.stdout)["nodes"] if n["state"] == "alive"]
        where = max(alive, key=lambda n: n["sessions"] + n["paused"])
        # A grace too short for any move: its sessions stay, each said so, state kept.
        drained = cloche("drain", where["id"], "--grace", "0.001", "--json")
        assert drained.returncode == 0, drained.stderr
        report = json.loads(drained.stdout)
        assert report["moved"] == 0 and report["failed"], report
        assert all("grace" in why for why in report["why"].values()), report
        assert nodes(http)[where["id"]]["state"] == "draining"
        resumed = cloche("resume", where["id"])
        assert resumed.returncode == 0 and "alive" in resumed.stdout, resumed.stderr
        assert run(http, session, "1 + 1") == 2
    # A leave finds its node by address: none is at this one (a documentation address).
    nowhere = cloche("leave", "--address", "203.0.113.9")
    assert nowhere.returncode != 0 and "not found" in nowhere.stderr, nowhere.stderr
    user = cloche("list", "--token", BETA)
    assert user.returncode != 0 and "admin" in user.stderr


def test_a_local_cluster_restarted_on_its_data_dir_has_its_sessions_back(tmp_path) -> None:
    require_cluster()
    data = tmp_path / "data"
    args = ("--cluster", "local:2", "--token", ALPHA, "--data-dir", str(data))
    first = ServerProcess(tmp_path / "state", *args)
    try:
        with client(first) as http:
            kept = [new_session(http, f"x = {i}\ng = iter(range(10))\nnext(g)") for i in range(4)]
    finally:
        assert first.stop() == 0, "".join(first.log[-30:])  # each node pauses its sessions
    second = ServerProcess(tmp_path / "state", *args)
    try:
        with client(second) as http:
            for i, session_id in enumerate(kept):
                assert run(http, session_id, "[x, next(g)]") == [i, 1]
                assert http.delete(f"/v1/sessions/{session_id}").status_code == 204
    finally:
        assert second.stop() == 0, "".join(second.log[-30:])
    for server in (first, second):  # each local cluster went whole
        assert not Path(ray_temp_of(server)).exists()
    assert list((tmp_path / "state").iterdir()) == []
