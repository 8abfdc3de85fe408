"""Two front ends of one local Ray cluster, each with the same webhook: the receiver (a real
HTTP server on 127.0.0.1) gets each event of a node's sessions, and each change of a node,
once, though both front ends tell them all on their streams (the parts alone are in
test_relay.py and test_node_events.py)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from support import ServerProcess, cluster_server, make_config

from .test_cluster_events import Stream, client, events

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]

ADMIN = "boss"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
WAIT_S = 180.0


class Receiver:
    """A webhook receiver on 127.0.0.1: keeps every event posted to it, answers 204."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                with receiver.changed:
                    receiver.events.append(json.loads(body))
                    receiver.changed.notify_all()
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hook"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def told(self) -> Counter[tuple[str, str]]:
        """How often each (type, session or node) came."""
        with self.changed:
            return Counter((e["type"], e["session_id"] or e["data"]["node"]) for e in self.events)

    def wait_for(self, wanted: Counter[tuple[str, str]]) -> None:
        with self.changed:
            got = self.changed.wait_for(lambda: not wanted - self._counted(), WAIT_S)
        assert got, f"the receiver got {self.told()}, not all of {wanted}"

    def _counted(self) -> Counter[tuple[str, str]]:
        return Counter((e["type"], e["session_id"] or e["data"]["node"]) for e in self.events)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(30)


@contextlib.contextmanager
def second_front_end(first_state: Path, address: str, hook: str) -> Iterator[ServerProcess]:
    """Another `cloche serve` on the same Ray cluster, with the same webhook."""
    (ray_token,) = first_state.glob("ray-token-*")  # the cluster's own
    second = ServerProcess(
        first_state.parent / "second-front-end",
        "--cluster", address, "--admin-token", ADMIN,
        "--webhook", hook, "--webhook-secret", SECRET,
        env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ray_token)},
    )  # fmt: skip
    try:
        yield second
    finally:
        assert second.stop() == 0, "".join(second.log[-30:])


def test_two_front_ends_deliver_each_node_event_to_a_webhook_once(tmp_path: Path) -> None:
    receiver = Receiver()
    state = tmp_path / "state"
    config = make_config(
        state,
        cluster="local:2",
        admin_tokens=frozenset({ADMIN}),
        pool_size=1,
        webhooks=(receiver.url,),
        webhook_secret=SECRET,
    )
    try:
        with cluster_server(config) as first, client(first, HEADERS) as one:
            cluster = one.get("/v1/cluster").json()
            nodes = sorted(node["id"] for node in cluster["nodes"])
            with (
                second_front_end(state, cluster["ray_address"], receiver.url) as second,
                client(second, HEADERS) as two,  # type: ignore[arg-type]
                events(two) as seen_by_second,
            ):
                assert sorted(n["id"] for n in two.get("/v1/cluster").json()["nodes"]) == nodes
                session_id = one.post("/v1/sessions").json()["id"]
                ran = one.post(f"/v1/sessions/{session_id}/execute", json={"code": "6 * 7"})
                assert ran.json()["result_json"] == 42
                assert one.delete(f"/v1/sessions/{session_id}").status_code == 204
                drained = nodes[0]
                assert one.post(f"/v1/cluster/nodes/{drained}/drain").status_code == 200
                told_by(seen_by_second, "node.draining", drained)  # it learnt it too
                assert one.post(f"/v1/cluster/nodes/{drained}/resume").status_code == 200
                told_by(seen_by_second, "node.up", drained)
                seen_by_second.until(
                    lambda seen: any(
                        f["type"] == "session.closed" and f["session_id"] == session_id
                        for f in seen
                    ),
                    "the session's events on the second front end's stream",
                )
                # Both told them all; the receiver gets each once, whichever delivers it.
                expected = Counter(
                    {
                        ("session.created", session_id): 1,
                        ("cell.started", session_id): 1,
                        ("cell.finished", session_id): 1,
                        ("session.closed", session_id): 1,
                        ("node.up", nodes[0]): 2,  # when it joined, and back from its drain
                        ("node.up", nodes[1]): 1,
                        ("node.draining", nodes[0]): 1,
                    }
                )
                receiver.wait_for(expected)
        # Both front ends stopped, their webhooks' queues emptied: nothing came twice.
        told = receiver.told()
        assert {key: told[key] for key in expected} == expected, told
    finally:
        receiver.close()


def told_by(stream: Stream, kind: str, node_id: str) -> None:
    """Wait until a front end's stream has told an event of the node after its last such."""
    before = len(stream.seen)
    stream.until(
        lambda seen: any(
            f["type"] == kind and f["data"].get("node") == node_id for f in seen[before:]
        ),
        f"{kind} of node {node_id}",
        WAIT_S,
    )
