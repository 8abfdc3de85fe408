"""Egress in cluster mode: each node's agent runs its sessions' doors, and a session's policy,
secrets' placeholders and trust in the interception CA move with it when its node drains."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloche.config import Limits
from egress_upstream import (
    AUTHORIZATIONS,
    SECRET_VALUE,
    UPSTREAM_HOST,
    Upstream,
    write_secrets,
)
from support import (
    NEVER_BEHIND_SLICE_S,
    ServerThread,
    cluster_server,
    make_config,
    make_test_ca,
)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

# One TLS context made before the move: the intercepted host's certificate must still verify
# on the new node (the nodes share the cluster's interception CA).
CLIENT = """
import json, ssl, urllib.request, urllib.error
context = ssl.create_default_context()
opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))
def fetch(url, token=None):
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", "Bearer " + token)
    try:
        with opener.open(request, timeout=30) as answer:
            return [answer.status, json.loads(answer.read())["path"]]
    except urllib.error.HTTPError as exc:
        return [exc.code, exc.headers.get("X-Cloche-Egress")]
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("egress-cluster")
    ca_file, context = make_test_ca(base, UPSTREAM_HOST)
    plain, secure = Upstream(), Upstream(context)
    policy = base / "egress.toml"
    policy.write_text(
        f'upstream_ca_file = "{ca_file}"\n'
        "[policies.secret]\n"
        f'allow = ["{UPSTREAM_HOST}:{plain.port}", "{UPSTREAM_HOST}:{secure.port}"]\n'
        'secrets = ["API_TOKEN"]\n'
    )
    secrets_file = write_secrets(base, secure.port)
    config = make_config(
        base / "state",
        cluster="local:2",
        egress_policy=policy,
        egress_audit=base / "audit.jsonl",
        egress_secrets=secrets_file,
        # About where egress goes, not time limits nor CPU placement (a TLS fetch on a
        # loaded machine takes seconds, behind the host's processes much longer).
        limits=Limits(cell_timeout_s=120.0, interrupt_grace_s=1.0),
        cell_slice_s=NEVER_BEHIND_SLICE_S,
    )
    try:
        with cluster_server(config) as server:
            yield {"server": server, "plain": plain, "secure": secure, "base": base}
    finally:
        plain.close()
        secure.close()


def audited(base: Path) -> dict[str, list[dict[str, Any]]]:
    """Each node's audit records, by the node's file."""
    return {
        path.name: [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(base.glob("audit-node-*.jsonl"))
    }


def ports_of(records: list[dict[str, Any]], session: str) -> set[int]:
    """The upstream ports of a session's connections that a node's door recorded."""
    return {r["port"] for r in records if r.get("session") == session and "port" in r}


def audited_once(base: Path, written: Callable[[dict[str, list[dict[str, Any]]]], bool]) -> Any:
    """Each node's audit records, once `written` holds of them (or after a minute): a door
    writes a connection's record as the connection ends, which may be after the cell whose
    fetch made it returned (3 ms after, 2 times in 20 on a quiet machine)."""
    deadline = time.monotonic() + 60
    while not written(records := audited(base)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return records


def holder(http: httpx.Client) -> dict[str, Any]:
    """The one node that holds a session, once the nodes' reports (every 0.5 s) say so."""
    deadline = time.monotonic() + 60
    while True:
        nodes = http.get("/v1/cluster").json()["nodes"]
        busy = [node for node in nodes if node["sessions"] + node["paused"] >= 1]
        if len(busy) == 1:
            return busy[0]
        assert time.monotonic() < deadline, nodes
        time.sleep(0.05)


def run(http: httpx.Client, session: str, code: str) -> Any:
    answer = http.post(f"/v1/sessions/{session}/execute", json={"code": code})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["status"] == "ok", body
    return body["result_json"]


def test_a_session_s_egress_goes_with_it_when_its_node_drains(world: dict[str, Any]) -> None:
    server: ServerThread = world["server"]
    plain = f"http://{UPSTREAM_HOST}:{world['plain'].port}"
    secure = f"https://{UPSTREAM_HOST}:{world['secure'].port}"
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=300) as http:
        made = http.post("/v1/sessions", json={"egress": "secret"})
        assert made.status_code == 201, made.text
        session = made.json()["id"]
        assert made.json()["egress"]["policy"] == "secret"
        run(http, session, CLIENT)
        placeholder = run(http, session, "import os; os.environ['API_TOKEN']")
        assert placeholder.startswith("cloche-secret-") and SECRET_VALUE not in placeholder
        AUTHORIZATIONS.clear()
        assert run(http, session, f"fetch({plain + '/before'!r})") == [200, "/before"]
        assert run(http, session, f"fetch({secure + '/before'!r}, {placeholder!r})") == [
            200,
            "/before",
        ]
        assert AUTHORIZATIONS == [("/before", None), ("/before", f"Bearer {SECRET_VALUE}")]
        # The node that holds it is the one whose door logged its connections.
        ports = {world["plain"].port, world["secure"].port}
        before = audited_once(
            world["base"],
            lambda now: ports <= set().union(*(ports_of(r, session) for r in now.values())),
        )
        holders = [name for name, records in before.items() if ports_of(records, session)]
        assert len(holders) == 1, before
        index = int(holders[0].removeprefix("audit-node-").removesuffix(".jsonl"))
        node = holder(http)

        drained = http.post(f"/v1/cluster/nodes/{node['id']}/drain")
        assert drained.status_code == 200, drained.text
        assert drained.json()["moved"] == 1 and drained.json()["failed"] == []

        # Elsewhere now: same placeholder, same policy, the same TLS context still trusts
        # the intercepted host, and the other node's door logged it.
        assert run(http, session, "os.environ['API_TOKEN']") == placeholder
        assert run(http, session, f"fetch({plain + '/after'!r})") == [200, "/after"]
        assert run(http, session, f"fetch({secure + '/after'!r}, {placeholder!r})") == [
            200,
            "/after",
        ]
        assert AUTHORIZATIONS[-1] == ("/after", f"Bearer {SECRET_VALUE}")
        other = f"audit-node-{1 - index}.jsonl"
        after = audited_once(
            world["base"], lambda now: ports <= ports_of(now.get(other, []), session)
        )
        assert ports <= ports_of(after.get(other, []), session), after
        assert http.get(f"/v1/sessions/{session}").json()["egress"]["policy"] == "secret"
        for path in world["base"].glob("audit*.jsonl"):
            assert SECRET_VALUE not in path.read_text()
        assert http.delete(f"/v1/sessions/{session}").status_code == 204


def test_asking_for_more_than_the_ceiling_or_none_on_a_cluster(world: dict[str, Any]) -> None:
    server: ServerThread = world["server"]
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=300) as http:
        wider = http.post(
            "/v1/sessions", json={"egress": {"policy": "secret", "allow": ["example.com:443"]}}
        )
        assert wider.status_code == 403, wider.text
        assert "example.com" in wider.text
        unknown = http.post("/v1/sessions", json={"egress": "no-such-policy"})
        assert unknown.status_code == 403, unknown.text
        made = http.post("/v1/sessions", json={})
        assert made.status_code == 201, made.text
        session = made.json()["id"]
        assert made.json()["egress"] is None
        code = (
            "import urllib.request\ntry:\n"
            f"    urllib.request.urlopen('http://{UPSTREAM_HOST}:{world['plain'].port}/', "
            "timeout=5)\n    r = 'reached'\nexcept OSError as exc:\n    r = type(exc).__name__\nr"
        )
        assert run(http, session, code) != "reached"
        assert http.delete(f"/v1/sessions/{session}").status_code == 204
