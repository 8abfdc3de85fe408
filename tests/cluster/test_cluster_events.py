"""A cluster front end's `GET /v1/events` tells what happens to sessions on its nodes (each
event with its node), and a node killed -9 has its sessions told closed, `node_lost`: a
local 2-node Ray cluster, real runsc (the relay's parts alone are in test_relay.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloche.sessions.session import owner_key
from support import ServerThread, cluster_server, make_config

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

USER = {"Authorization": "Bearer t1"}
ADMIN = {"Authorization": "Bearer boss"}
Frame = dict[str, Any]


@contextlib.contextmanager
def admin_cluster(state_dir: Path) -> Iterator[ServerThread]:
    """Two nodes; a user's token t1 and an admin's, boss."""
    config = make_config(
        state_dir,
        cluster="local:2",
        tokens=frozenset({"t1"}),
        admin_tokens=frozenset({"boss"}),
        pool_size=1,
    )
    with cluster_server(config) as running:
        yield running


@pytest.fixture(scope="module")
def cluster(state_root: Path) -> Iterator[ServerThread]:
    with admin_cluster(state_root) as running:
        yield running


def client(server: ServerThread, headers: dict[str, str]) -> httpx.Client:
    return httpx.Client(
        base_url=f"http://127.0.0.1:{server.http_port}", headers=headers, timeout=120
    )


class Stream:
    """An open `GET /v1/events`, read event by event (heartbeat comments skipped)."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.iter_lines()
        self.seen: list[Frame] = []

    def _frame(self) -> Frame | None:
        """The next event, or None for a comment (a heartbeat, every 15 s at most)."""
        fields: dict[str, str] = {}
        for line in self._lines:
            if line.startswith(":"):
                return None
            if line == "":
                if fields:
                    return {"id": int(fields["id"]), **json.loads(fields["data"])}
                continue
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")
        raise AssertionError("the stream ended")

    def until(
        self, done: Callable[[list[Frame]], bool], what: str, timeout_s: float = 120.0
    ) -> None:
        """Read until done(every event seen so far) holds."""
        give_up = time.monotonic() + timeout_s
        while not done(self.seen):
            assert time.monotonic() < give_up, f"no {what} in {timeout_s:g} s: {self.seen}"
            frame = self._frame()
            if frame is not None:
                self.seen.append(frame)

    def of(self, session_id: str, kind: str | None = None) -> list[Frame]:
        return [
            f
            for f in self.seen
            if f["session_id"] == session_id and (kind is None or f["type"] == kind)
        ]


@contextlib.contextmanager
def events(http: httpx.Client) -> Iterator[Stream]:
    with http.stream("GET", "/v1/events") as response:
        assert response.status_code == 200, response.read()
        opened = Stream(response)
        assert opened._frame() is None  # ": subscribed": nothing is missed from now on
        yield opened


def node_ids(server: ServerThread) -> dict[str, dict[str, Any]]:
    with client(server, ADMIN) as admin:
        response = admin.get("/v1/cluster")
    assert response.status_code == 200, response.text
    return {node["id"]: node for node in response.json()["nodes"]}


def test_a_session_s_life_on_a_node_reaches_the_front_end_s_stream(cluster) -> None:
    nodes = node_ids(cluster)
    with client(cluster, USER) as http, events(http) as stream:
        session_id = http.post("/v1/sessions").json()["id"]
        cell = http.post(f"/v1/sessions/{session_id}/execute", json={"code": "6 * 7"})
        assert cell.json()["result_json"] == 42
        assert http.delete(f"/v1/sessions/{session_id}").status_code == 204
        stream.until(lambda _: stream.of(session_id, "session.closed"), "session.closed")
        mine = stream.of(session_id)
    assert [f["type"] for f in mine] == [
        "session.created",
        "cell.started",
        "cell.finished",
        "session.closed",
    ]
    (node,) = {f["data"]["node"] for f in mine}  # told by the node that holds it
    assert node in nodes and nodes[node]["state"] == "alive"
    assert {f["owner"] for f in mine} == {owner_key("t1")[:8]}  # the user's own: scoped
    assert mine[2]["data"]["end_reason"] == "ok"
    assert mine[3]["data"]["end_reason"] == "closed"
    ids = [f["id"] for f in mine]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def test_a_killed_node_s_sessions_are_told_closed_node_lost_once(cluster) -> None:
    with client(cluster, USER) as http, events(http) as stream:
        made = [http.post("/v1/sessions").json()["id"] for _ in range(4)]
        for session_id in made:  # each is live, with a cell run
            cell = http.post(f"/v1/sessions/{session_id}/execute", json={"code": "x = 1"})
            assert cell.json()["status"] == "ok"
        stream.until(
            lambda _: all(stream.of(s, "cell.finished") for s in made), "every cell.finished"
        )
        where = {s: stream.of(s, "session.created")[0]["data"]["node"] for s in made}
        victim = Counter(where.values()).most_common(1)[0][0]
        on_victim = sorted(s for s in made if where[s] == victim)
        others = [s for s in made if where[s] != victim]
        pid = node_ids(cluster)[victim]["pid"]
        assert pid != os.getpid()  # the agent's own process, which this test's cluster made

        os.kill(pid, signal.SIGKILL)
        stream.until(
            lambda _: all(stream.of(s, "session.closed") for s in on_victim),
            "session.closed for each session of the killed node",
        )
        # Then a session of the living node's whole life: anything told twice came before.
        after = http.post("/v1/sessions").json()["id"]
        for session_id in others + [after]:
            assert http.delete(f"/v1/sessions/{session_id}").status_code == 204
        stream.until(
            lambda _: all(stream.of(s, "session.closed") for s in others + [after]),
            "the living node's sessions closed",
        )
    for session_id in on_victim:
        (closed,) = stream.of(session_id, "session.closed")
        assert closed["data"] == {"end_reason": "node_lost", "reason": "lost", "node": victim}
        assert closed["owner"] == owner_key("t1")[:8]
    for session_id in others + [after]:
        (closed,) = stream.of(session_id, "session.closed")
        assert closed["data"]["end_reason"] == "closed" and closed["data"]["node"] != victim
    assert node_ids(cluster)[victim]["state"] == "dead"
    with client(cluster, ADMIN) as admin:
        text = admin.get("/metrics").text
    told = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "cloche_session_ends_total"
        and sample.labels == {"end_reason": "node_lost"}  # the front end's own count
    ]
    assert told == [len(on_victim)]
