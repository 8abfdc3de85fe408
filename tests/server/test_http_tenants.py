"""Tenants against a real gVisor server: each sees only its own sessions and snapshots, a
user can't reach the cluster's admin verbs, an admin lists everyone's, and a quota makes a
creation wait for room and then refuses it with 429, on every front end that creates."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloche.client.tcp import TCPClient
from cloche.sessions.observer import Observer
from cloche.sessions.quotas import QuotaGate
from support import ServerThread, make_config, require_gvisor

ALICE, BOB, SOLO, OPS = "alice-token", "bob-token", "solo-token", "ops-token"
QUOTA_WAIT_S = 3.0
TOKENS = f"""
[tokens.alice]
token = "{ALICE}"
max_live_sessions = 10

[tokens.bob]
token_sha256 = "{hashlib.sha256(BOB.encode()).hexdigest()}"

[tokens.solo]
token = "{SOLO}"
max_live_sessions = 1

[tokens.ops]
token = "{OPS}"
role = "admin"
"""


class Waiting(Observer):
    """Passes events on to the server's observer, and says when a request starts waiting."""

    def __init__(self, passed_on: Observer) -> None:
        self.passed_on = passed_on
        self.started = threading.Event()
        self.events: list[tuple[str, dict[str, Any]]] = []

    def event(self, kind, session_id, owner_key, data):  # type: ignore[no-untyped-def]
        self.events.append((kind, data))
        if kind == "quota.exceeded" and data["outcome"] == "waiting":
            self.started.set()
        self.passed_on.event(kind, session_id, owner_key, data)


@pytest.fixture(scope="module")
def tenants(state_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    require_gvisor()
    tokens = tmp_path_factory.mktemp("tenants") / "tokens.toml"
    tokens.write_text(TOKENS)
    tokens.chmod(0o600)
    config = make_config(state_root, tokens_file=tokens, quota_wait_s=QUOTA_WAIT_S, pool_size=2)
    with ServerThread(config) as running:
        yield running


@pytest.fixture
def waiting(tenants: ServerThread) -> Iterator[Waiting]:
    gate = tenants.server.sessions
    assert isinstance(gate, QuotaGate)
    told = Waiting(gate.observer)
    gate.observer = told
    yield told
    gate.observer = told.passed_on


def api(server: ServerThread, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=f"http://127.0.0.1:{server.http_port}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=120,
    )


def ids(response: httpx.Response) -> set[str]:
    assert response.status_code == 200, response.text
    return {session["id"] for session in response.json()["sessions"]}


def new_session(client: httpx.Client) -> str:
    made = client.post("/v1/sessions")
    assert made.status_code == 201, made.text
    return str(made.json()["id"])


def test_neither_tenant_sees_the_other_s_sessions_or_snapshots(tenants):
    with api(tenants, ALICE) as alice, api(tenants, BOB) as bob:
        mine, theirs = new_session(alice), new_session(bob)
        assert alice.post(f"/v1/sessions/{mine}/execute", json={"code": "x = 1"}).is_success
        snapshot = alice.post(f"/v1/sessions/{mine}/snapshot", json={"name": "a"})
        assert snapshot.status_code == 201, snapshot.text
        snapshot_id = snapshot.json()["id"]
        try:
            assert ids(alice.get("/v1/sessions")) == {mine}
            assert ids(bob.get("/v1/sessions")) == {theirs}
            assert ids(bob.get("/v1/sessions", params={"all": "true"})) == {theirs}
            for verb, path in (
                ("GET", f"/v1/sessions/{mine}"),
                ("POST", f"/v1/sessions/{mine}/execute"),
                ("DELETE", f"/v1/sessions/{mine}"),
                ("GET", f"/v1/snapshots/{snapshot_id}"),
                ("DELETE", f"/v1/snapshots/{snapshot_id}"),
            ):
                body = {"code": "x"} if path.endswith("execute") else None
                refused = bob.request(verb, path, json=body)
                assert refused.status_code == 404, (verb, path, refused.text)
            listed = bob.get("/v1/snapshots")
            assert listed.status_code == 200
            assert snapshot_id not in {s["id"] for s in listed.json()["snapshots"]}
            restore = bob.post("/v1/sessions", json={"snapshot": snapshot_id})
            assert restore.status_code == 404, restore.text
        finally:
            assert alice.delete(f"/v1/snapshots/{snapshot_id}").status_code == 204
            assert alice.delete(f"/v1/sessions/{mine}").status_code == 204
            assert bob.delete(f"/v1/sessions/{theirs}").status_code == 204


def test_a_user_s_token_gets_403_on_the_cluster_view_drain_and_resume(tenants):
    verbs = (
        ("GET", "/v1/cluster", "view the cluster"),
        ("POST", "/v1/cluster/nodes/n1/drain", "drain a node"),
        ("POST", "/v1/cluster/nodes/n1/resume", "return a node to service"),
    )
    with api(tenants, ALICE) as alice, api(tenants, OPS) as ops:
        for verb, path, what in verbs:
            refused = alice.request(verb, path)
            assert refused.status_code == 403, refused.text
            error = refused.json()["error"]
            assert error["type"] == "forbidden"
            assert (
                f"only an admin may {what}: tenant 'alice' has the role 'user'" in error["message"]
            )
            assert "--admin-token" in error["message"]
            # An admin gets past the role: this server is not a cluster.
            assert ops.request(verb, path).status_code == 404
    with httpx.Client(base_url=f"http://127.0.0.1:{tenants.http_port}") as anonymous:
        assert anonymous.get("/v1/cluster").status_code == 401


def test_an_admin_lists_every_tenant_s_sessions_with_all_true(tenants):
    with api(tenants, ALICE) as alice, api(tenants, BOB) as bob, api(tenants, OPS) as ops:
        hers, his = new_session(alice), new_session(bob)
        try:
            assert {hers, his} <= ids(ops.get("/v1/sessions", params={"all": "true"}))
            assert ids(ops.get("/v1/sessions")) == set()  # its own: none
            assert ids(alice.get("/v1/sessions", params={"all": "true"})) == {hers}
        finally:
            assert alice.delete(f"/v1/sessions/{hers}").status_code == 204
            assert bob.delete(f"/v1/sessions/{his}").status_code == 204


def test_over_its_live_quota_a_creation_waits_then_gets_429_on_every_front_end(tenants, waiting):
    with api(tenants, SOLO) as solo:
        held = new_session(solo)
        try:
            attempts = {
                "http": lambda: _refusal(solo.post("/v1/sessions")),
                "terrarium": lambda: _refusal(solo.post("/", json={"code": "1"}), terrarium=True),
                "jupyter": lambda: _refusal(solo.post("/api/kernels", json={"name": "python3"})),
                "tcp": lambda: _tcp_refusal(tenants),
            }
            started = time.monotonic()
            with ThreadPoolExecutor(len(attempts)) as pool:
                futures = {name: pool.submit(attempt) for name, attempt in attempts.items()}
                answers = {name: future.result(120) for name, future in futures.items()}
            assert time.monotonic() - started >= QUOTA_WAIT_S - 0.1  # each waited for room
            for name, (status, retry_after, message) in answers.items():
                assert "tenant 'solo' is at its max_live_sessions quota of 1" in message, name
                assert "--quota-wait" in message and "--tokens" in message, name
                if name != "tcp":
                    assert (status, retry_after) == (429, "3"), name
            outcomes = [d["outcome"] for kind, d in waiting.events if kind == "quota.exceeded"]
            assert outcomes.count("waiting") == 4 and outcomes.count("refused") == 4
            assert ids(solo.get("/v1/sessions")) == {held}
        finally:
            assert solo.delete(f"/v1/sessions/{held}").status_code == 204


def _refusal(response: httpx.Response, terrarium: bool = False) -> tuple[int, str | None, str]:
    body = response.json()
    if terrarium:
        assert body["success"] is False
    assert body["error"]["type"] == "quota_exceeded", body
    return response.status_code, response.headers.get("retry-after"), body["error"]["message"]


def _tcp_refusal(server: ServerThread) -> tuple[int, None, str]:
    with TCPClient("127.0.0.1", server.tcp_port) as tcp:
        reply = tcp.run("1", token=SOLO)
    assert reply["status"] == "error" and "session_id" not in reply
    return 0, None, reply["error"]


def test_a_waiting_creation_is_let_through_when_the_other_session_closes(tenants, waiting):
    with api(tenants, SOLO) as solo, ThreadPoolExecutor(1) as pool:
        held = new_session(solo)
        second = pool.submit(solo.post, "/v1/sessions")
        assert waiting.started.wait(60), "the second creation never started waiting"
        assert not second.done()
        assert solo.delete(f"/v1/sessions/{held}").status_code == 204
        made = second.result(120)
        assert made.status_code == 201, made.text
        assert ids(solo.get("/v1/sessions")) == {made.json()["id"]}
        assert solo.delete(f"/v1/sessions/{made.json()['id']}").status_code == 204
    outcomes = [d["outcome"] for kind, d in waiting.events if kind == "quota.exceeded"]
    assert outcomes == ["waiting"]


def test_a_tenant_s_webhook_receives_only_its_own_sessions_events(state_root, tmp_path):
    from cloche.server.app import Server

    require_gvisor()
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        TOKENS.replace(
            "max_live_sessions = 10\n",
            'max_live_sessions = 10\nwebhook = "http://127.0.0.1:9/alice"\n'
            'webhook_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"\n',
        )
    )
    tokens.chmod(0o600)
    server = Server(make_config(state_root, tokens_file=tokens))
    (receiver,) = server.webhooks.receivers  # never started: nothing is sent
    assert receiver.url == "http://127.0.0.1:9/alice"
    assert receiver.owner_key == hashlib.sha256(ALICE.encode()).hexdigest()


def test_a_tenant_s_sessions_get_its_egress_policy_unless_they_ask(make_server, tmp_path):
    from cloche.errors import ConfigError
    from cloche.server.app import Server

    policies = tmp_path / "egress.toml"
    policies.write_text('[policies.research]\nallow = ["example.invalid:443"]\n')
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS.replace("max_live_sessions = 10\n", 'egress = "research"\n'))
    tokens.chmod(0o600)
    server = make_server(tokens_file=tokens, egress_policy=policies, pool_size=1)
    with api(server, ALICE) as alice, api(server, BOB) as bob:
        hers = alice.post("/v1/sessions")
        assert hers.status_code == 201, hers.text
        assert hers.json()["egress"]["policy"] == "research"
        his = bob.post("/v1/sessions")
        assert his.status_code == 201, his.text
        assert his.json()["egress"] is None  # no default policy, nothing asked: no network
        for client, made in ((alice, hers), (bob, his)):
            assert client.delete(f"/v1/sessions/{made.json()['id']}").status_code == 204
    policies.write_text('[policies.other]\nallow = ["example.invalid:443"]\n')
    with pytest.raises(ConfigError, match="tenant 'alice' has egress = 'research'"):
        Server(make_config(tmp_path / "state", tokens_file=tokens, egress_policy=policies))
