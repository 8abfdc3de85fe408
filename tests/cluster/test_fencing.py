"""Fencing on a local 2-node Ray cluster with real runsc: a node agent frozen (SIGSTOP) until
the front end declares its node dead, then thawed (SIGCONT), serves none of its old sessions
again. It removes their sandboxes and paused images at once and ends; its machine comes back
under a new node id with nothing on it; the old sessions keep answering "lost"; the other
node's sessions never notice (the agent's own part, without Ray, is in
test_agent_fencing.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from support import NOTHING_LEFT, ServerThread, leftovers

from .test_cluster_events import USER, Stream, admin_cluster, client, events, node_ids

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

DEAD_WITHIN_S = 90.0  # the front end's deadline (--node-deadline) is 30 s; a loaded machine is slow
BACK_WITHIN_S = 240.0  # fenced, then a new agent started (its pool filled) and joined


@pytest.fixture(scope="module")
def cluster(state_root: Path) -> Iterator[ServerThread]:
    with admin_cluster(state_root / "fencing") as running:
        yield running


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def run(http: httpx.Client, session_id: str, code: str) -> httpx.Response:
    return http.post(f"/v1/sessions/{session_id}/execute", json={"code": code})


def answers_lost(http: httpx.Client, session_id: str) -> None:
    for response in (run(http, session_id, "x"), http.get(f"/v1/sessions/{session_id}")):
        assert response.status_code == 410, response.text
        assert response.json()["error"]["message"] == (
            f"Session {session_id} was lost: its node failed"
        )


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) for the block; continued (SIGCONT) however it ends."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_node_declared_dead_that_comes_back_fences_itself_and_rejoins_as_new(
    cluster: ServerThread,
) -> None:
    state_dir = cluster.config.state_dir
    data_dir = cluster.config.data_dir
    before = node_ids(cluster)
    assert len(before) == 2 and {n["state"] for n in before.values()} == {"alive"}
    with client(cluster, USER) as http, events(http) as stream:
        made: list[str] = []
        where: dict[str, str] = {}  # session id -> its node, as its events tell

        def spread() -> bool:
            shares = Counter(where.values())
            return len(shares) == 2 and min(shares.values()) >= 2

        while len(made) < 12 and not spread():
            created = http.post("/v1/sessions")
            assert created.status_code == 201, created.text
            session_id = created.json()["id"]
            assert run(http, session_id, f"x = {len(made)}").json()["status"] == "ok"
            made.append(session_id)
            where[session_id] = node_of(stream, session_id)
        assert spread() and set(where.values()) == set(before), where
        victim = where[made[0]]
        pid = before[victim]["pid"]
        assert pid != os.getpid()  # its agent's own process, which this test's cluster made
        on_victim = [s for s in made if where[s] == victim]
        others = [s for s in made if where[s] != victim]
        assert len(on_victim) >= 2 and others
        paused = on_victim[0]  # an image on the node's disk
        assert http.post(f"/v1/sessions/{paused}/pause").status_code == 200
        (instance,) = [p.name for p in state_dir.glob(f"node-*/{pid}-*") if p.is_dir()]
        node_state = next(p.parent for p in state_dir.glob(f"node-*/{instance}"))
        (image,) = data_dir.glob(f"node-*/sessions/{paused}")
        assert image.is_dir()
        assert leftovers(node_state, instance)["processes"] != []  # its live sessions' runsc

        stopped_at = time.monotonic()
        with frozen(pid):
            wait_for(
                lambda: node_ids(cluster)[victim]["state"] == "dead",
                "the frozen node to be declared dead",
                DEAD_WITHIN_S,
            )
            print(f"declared dead {time.monotonic() - stopped_at:.1f} s after SIGSTOP")
            for session_id in on_victim:
                answers_lost(http, session_id)
            # Frozen, it can't remove anything: its sandboxes run on (what a node that
            # comes back kept until the cluster stopped, before fencing).
            assert leftovers(node_state, instance)["processes"] != []
            assert image.is_dir()

        # Thawed: it learns it was declared dead, removes all it held, and ends.
        thawed_at = time.monotonic()
        wait_for(
            lambda: leftovers(node_state, instance) == NOTHING_LEFT,
            "the fenced node's sandboxes, mounts, cgroups and state to go",
            BACK_WITHIN_S,
        )
        print(f"its sandboxes gone {time.monotonic() - thawed_at:.1f} s after SIGCONT")
        assert not image.exists()  # the paused session's image: it must not come back
        wait_for(lambda: process_gone(pid), "the fenced agent's process to end", BACK_WITHIN_S)

        def successor() -> str | None:
            fresh = [i for i, n in node_ids(cluster).items() if i not in before]
            alive = [i for i in fresh if node_ids(cluster)[i]["state"] == "alive"]
            return alive[0] if alive else None

        wait_for(lambda: successor() is not None, "a new node on the machine", BACK_WITHIN_S)
        new_id = successor()
        assert new_id is not None
        print(f"back as node {new_id} {time.monotonic() - thawed_at:.1f} s after SIGCONT")
        now = node_ids(cluster)
        assert now[victim]["state"] == "dead" and now[new_id]["pid"] != pid
        assert now[new_id]["sessions"] == 0 and now[new_id]["paused"] == 0  # nothing on it
        assert len(now) == 3

        for session_id in on_victim:  # still lost, never "not found" nor a stale answer
            answers_lost(http, session_id)
        for session_id in others:  # the other node's: undisturbed, their state intact
            ran = run(http, session_id, "x")
            assert ran.status_code == 200, ran.text
            assert ran.json()["result_json"] == made.index(session_id)

        # The new node takes new sessions (the emptiest, it gets the next one).
        fresh = http.post("/v1/sessions").json()["id"]
        assert run(http, fresh, "6 * 7").json()["result_json"] == 42
        assert node_of(stream, fresh) == new_id

        for session_id in [*others, fresh]:
            assert http.delete(f"/v1/sessions/{session_id}").status_code == 204
        stream.until(
            lambda _: all(stream.of(s, "session.closed") for s in [*others, fresh]),
            "the live sessions closed",
        )
    told_lost(stream, on_victim, victim)
    for session_id in others:
        (closed,) = stream.of(session_id, "session.closed")
        assert closed["data"]["end_reason"] == "closed"


def node_of(stream: Stream, session_id: str) -> str:
    """The node a session was created on, as its `session.created` event says."""
    stream.until(lambda _: stream.of(session_id, "session.created"), "session.created")
    node: str = stream.of(session_id, "session.created")[0]["data"]["node"]
    return node


def told_lost(stream: Stream, session_ids: list[str], node_id: str) -> None:
    """Each session was told closed once, lost with its node (the fenced agent's own closes
    of them are never relayed)."""
    for session_id in session_ids:
        (closed,) = stream.of(session_id, "session.closed")
        assert closed["data"] == {"end_reason": "node_lost", "reason": "lost", "node": node_id}
