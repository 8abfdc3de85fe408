"""Webhooks: Standard Webhooks signatures, and delivery to a real HTTP receiver on loopback
(at least once, in order, retried while it is down, never delaying a publish)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import stat
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloche.cli import build_parser
from cloche.commands.serve import config_from_args
from cloche.errors import ConfigError
from cloche.server.events import EventBus
from cloche.server.webhooks import (
    SECRET_FILE,
    Webhooks,
    make_secret,
    secret_key,
    server_secret,
    sign,
)
from cloche.sessions.session import owner_key

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # the Standard Webhooks spec's example
WAIT_S = 30.0  # for what should take a second or two, on a busy machine


# -- a receiver: a real HTTP server on 127.0.0.1, in a thread --------------------------------


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        receiver = self.server.receiver
        body = self.rfile.read(int(self.headers["content-length"]))
        headers = {name.lower(): value for name, value in self.headers.items()}
        status = receiver.take(headers, body)
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    receiver: Receiver


class Receiver:
    """Records each request; answers 200, or 503 for the first `fail_first`, or hangs
    (until `release`) while `hang` is set. Bound at once, it listens only after `up()`:
    until then, connections to it are refused."""

    def __init__(self) -> None:
        self.attempts: list[tuple[dict[str, str], bytes]] = []
        self.accepted: list[tuple[dict[str, str], bytes]] = []
        self.fail_first = 0
        self.hang = False
        self.hanging = threading.Event()  # a request is being held now
        self.release = threading.Event()
        self._changed = threading.Condition()
        self._server = _Server(("127.0.0.1", 0), _Handler, bind_and_activate=False)
        self._server.receiver = self
        self._server.server_bind()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hook?key=not-logged"
        self._thread: threading.Thread | None = None

    def up(self) -> None:
        self._server.server_activate()
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.release.set()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(WAIT_S)
        self._server.server_close()

    def take(self, headers: dict[str, str], body: bytes) -> int:
        with self._changed:
            self.attempts.append((headers, body))
            self._changed.notify_all()
        if self.hang:
            self.hanging.set()
            self.release.wait(WAIT_S)
        with self._changed:
            if len(self.attempts) <= self.fail_first:
                return 503
            self.accepted.append((headers, body))
            self._changed.notify_all()
            return 200

    def wait_accepted(self, count: int, timeout_s: float = WAIT_S) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: len(self.accepted) >= count, timeout_s)

    def accepted_events(self) -> list[dict[str, Any]]:
        return [json.loads(body) for _, body in self.accepted]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    made.up()
    yield made
    made.close()


class Counts:
    def __init__(self) -> None:
        self.outcomes: dict[str, int] = {}

    def __call__(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


@pytest.fixture
def counts() -> Counts:
    return Counts()


@pytest.fixture
async def hooks(counts: Counts) -> AsyncIterator[Webhooks]:
    webhooks = Webhooks(retry_s=WAIT_S, count=counts, timeout_s=WAIT_S, stop_grace_s=0.1)
    yield webhooks
    await webhooks.stop()


def bus_for(webhooks: Webhooks) -> EventBus:
    bus = EventBus(first_id=1)
    bus.listen(webhooks.offer)
    return bus


def verify(secret: str, headers: dict[str, str], body: bytes) -> None:
    """A receiver's check, as the Standard Webhooks spec writes it (not cloche's code)."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.{body.decode()}"
    expected = base64.b64encode(hmac.new(key, signed.encode(), hashlib.sha256).digest())
    given = [s.split(",", 1) for s in headers["webhook-signature"].split(" ")]
    assert ["v1", expected.decode()] in given
    assert abs(time.time() - int(headers["webhook-timestamp"])) < 300


async def until(predicate: Any, what: str) -> None:
    """Poll a condition of the event loop's side, with a deadline."""
    give_up = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < give_up, f"not in {WAIT_S} s: {what}"
        await asyncio.sleep(0.01)


# -- secrets and signatures --------------------------------------------------------------------


def test_the_signature_is_the_standard_webhooks_test_vector():
    signature = sign(
        secret_key(SECRET), "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}'
    )
    assert signature == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


@pytest.mark.parametrize(
    "secret", ["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_not base64!", "whsec_"]
)
def test_malformed_secrets_are_refused(secret):
    with pytest.raises(ValueError, match="secret"):
        secret_key(secret)


def test_a_made_secret_is_whsec_and_24_random_bytes():
    first, second = make_secret(), make_secret()
    assert first.startswith("whsec_")
    assert len(secret_key(first)) == 24
    assert first != second


def test_without_a_secret_one_is_made_once_kept_0600_and_reused(tmp_path):
    data_dir = tmp_path / "data"
    made = server_secret(None, data_dir)
    path = data_dir / SECRET_FILE
    assert path.read_text().strip() == made
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(secret_key(made)) == 24
    assert server_secret(None, data_dir) == made


def test_a_given_secret_is_used_and_none_is_written(tmp_path):
    assert server_secret(SECRET, tmp_path) == SECRET
    assert not (tmp_path / SECRET_FILE).exists()
    with pytest.raises(ConfigError, match="--webhook-secret"):
        server_secret("hunter2", tmp_path)


def test_a_damaged_kept_secret_is_refused_with_what_to_do(tmp_path):
    (tmp_path / SECRET_FILE).write_text("garbage\n")
    with pytest.raises(ConfigError, match="remove it"):
        server_secret(None, tmp_path)


@pytest.mark.parametrize("url", ["ftp://example.com/hook", "not a url", "http:///nohost"])
def test_a_url_that_is_not_http_is_refused(url):
    with pytest.raises(ValueError, match="http"):
        Webhooks().add_receiver(url, SECRET)


def test_serve_flags_describe_the_webhooks(tmp_path):
    args = build_parser().parse_args(
        [
            "serve",
            "--webhook",
            "http://127.0.0.1:9/a",
            "--webhook",
            "https://hooks.example/b",
            "--webhook-secret",
            SECRET,
            "--webhook-retry",
            "5",
            "--events-buffer",
            "50",
        ]
    )
    config = config_from_args(args)
    assert config.webhooks == ("http://127.0.0.1:9/a", "https://hooks.example/b")
    assert config.webhook_secret == SECRET
    assert SECRET not in repr(config)
    assert (config.webhook_retry_s, config.events_buffer) == (5.0, 50)
    for flag, value in (("--webhook-retry", "0"), ("--events-buffer", "-1")):
        with pytest.raises(ConfigError, match=flag):
            config_from_args(build_parser().parse_args(["serve", flag, value]))


# -- delivery ----------------------------------------------------------------------------------


async def test_every_event_is_delivered_in_order_and_signed(hooks, counts, receiver):
    hooks.add_receiver(receiver.url, SECRET)
    hooks.start()
    bus = bus_for(hooks)
    published = [bus.publish("cell.finished", "s1", None, {"i": i}) for i in range(20)]
    assert await asyncio.to_thread(receiver.wait_accepted, 20)
    assert receiver.accepted_events() == [e.public() for e in published]
    for (headers, body), event in zip(receiver.accepted, published, strict=True):
        assert headers["webhook-id"] == str(event.id)
        assert headers["content-type"] == "application/json"
        verify(SECRET, headers, body)
    await until(lambda: counts.outcomes == {"delivered": 20}, "20 counted delivered")


async def test_a_receiver_that_refuses_connections_gets_the_events_once_it_is_up(hooks, counts):
    down = Receiver()  # bound, not listening: connections are refused
    try:
        watched = hooks.add_receiver(down.url, SECRET)
        hooks.start()
        bus = bus_for(hooks)
        published = [bus.publish("session.created", f"s{i}", None, {}) for i in range(3)]
        await until(lambda: watched.retried >= 2, "the first event retried twice")
        down.up()
        assert await asyncio.to_thread(down.wait_accepted, 3)
        assert [e["id"] for e in down.accepted_events()] == [e.id for e in published]
        await until(lambda: counts.outcomes.get("delivered") == 3, "3 counted delivered")
        assert counts.outcomes["retried"] >= 2
        assert "dropped" not in counts.outcomes
    finally:
        down.close()


async def test_a_receiver_answering_503_gets_the_events_when_it_recovers(hooks, receiver):
    receiver.fail_first = 2
    hooks.add_receiver(receiver.url, SECRET)
    hooks.start()
    bus = bus_for(hooks)
    published = [bus.publish("cell.started", "s1", None, {}) for _ in range(2)]
    assert await asyncio.to_thread(receiver.wait_accepted, 2)
    assert [e["id"] for e in receiver.accepted_events()] == [e.id for e in published]
    retries = [h for h, _ in receiver.attempts[:3]]
    assert {h["webhook-id"] for h in retries} == {str(published[0].id)}  # stable across retries
    for headers, body in receiver.attempts:
        verify(SECRET, headers, body)  # each attempt signed afresh


async def test_a_hanging_receiver_delays_no_publish_and_no_other_receiver(hooks, receiver):
    stuck = Receiver()
    stuck.hang = True
    stuck.up()
    try:
        hooks.add_receiver(stuck.url, SECRET)
        hooks.add_receiver(receiver.url, SECRET)
        hooks.start()
        bus = bus_for(hooks)
        bus.publish("session.created", "s0", None, {})
        assert await asyncio.to_thread(stuck.hanging.wait, WAIT_S)  # held from now on
        started = time.perf_counter()
        for i in range(1000):
            bus.publish("cell.finished", "s0", None, {"i": i})
        publishing_s = time.perf_counter() - started
        assert publishing_s < 0.5, f"1000 publishes took {publishing_s:.3f} s"
        assert await asyncio.to_thread(receiver.wait_accepted, 1001)
        assert len(stuck.accepted) == 0
    finally:
        stuck.close()


async def test_an_event_not_delivered_within_the_retry_time_is_dropped_and_counted(
    counts, receiver
):
    receiver.fail_first = 1_000_000
    hooks = Webhooks(retry_s=1.0, count=counts, stop_grace_s=0.1)
    try:
        watched = hooks.add_receiver(receiver.url, SECRET)
        hooks.start()
        bus = bus_for(hooks)
        for _ in range(2):
            bus.publish("session.closed", "s1", None, {})
        await until(lambda: watched.dropped == 2, "both events dropped")
        assert counts.outcomes["dropped"] == 2
        assert counts.outcomes["retried"] >= 1
        assert "delivered" not in counts.outcomes
        assert not watched.queue
    finally:
        await hooks.stop()


def test_a_full_queue_drops_and_counts_without_waiting(counts):
    hooks = Webhooks(queue_bound=2, count=counts)
    watched = hooks.add_receiver("http://127.0.0.1:9/never-started", SECRET)
    bus = bus_for(hooks)  # not started: nothing is taken off the queue
    for _ in range(5):
        bus.publish("cell.finished", None, None, {})
    assert [event.id for event, _ in watched.queue] == [1, 2]
    assert watched.dropped == 3
    assert counts.outcomes == {"dropped": 3}


async def test_a_tenants_receiver_gets_only_its_sessions_events(hooks, receiver):
    other = Receiver()
    other.up()
    try:
        hooks.add_receiver(receiver.url, SECRET, owner_key=owner_key("tenant-a"))
        hooks.add_receiver(other.url, SECRET)  # the server's: everything
        hooks.start()
        bus = bus_for(hooks)
        bus.publish("session.created", "of-b", owner_key("tenant-b"), {})
        mine = bus.publish("session.created", "of-a", owner_key("tenant-a"), {})
        bus.publish("node.dead", None, None, {})
        assert await asyncio.to_thread(other.wait_accepted, 3)
        assert await asyncio.to_thread(receiver.wait_accepted, 1)
        assert [e["id"] for e in receiver.accepted_events()] == [mine.id]
    finally:
        other.close()


async def test_an_event_for_some_receivers_goes_to_those_alone(hooks, receiver):
    """A cluster front end names the receivers whose delivery it claimed (another front end
    delivers it to the rest); an event that names none goes to every receiver."""
    other = Receiver()
    other.up()
    try:
        claimed = hooks.add_receiver(receiver.url, SECRET)
        unclaimed = hooks.add_receiver(other.url, SECRET)
        assert claimed.id != unclaimed.id and hooks.ids() == {claimed.id, unclaimed.id}
        # The same URL and owner make the same id on every front end; another owner, not.
        assert Webhooks().add_receiver(receiver.url, make_secret()).id == claimed.id
        assert Webhooks().add_receiver(receiver.url, SECRET, owner_key("t")).id != claimed.id
        hooks.start()
        bus = bus_for(hooks)
        bus.publish("cell.finished", "s1", None, {}, frozenset({claimed.id}))
        bus.publish("cell.finished", "s2", None, {}, frozenset())  # another's, everywhere
        bus.publish("cell.finished", "s3", None, {})  # this server's own: for all
        assert await asyncio.to_thread(receiver.wait_accepted, 2)
        assert await asyncio.to_thread(other.wait_accepted, 1)
        await hooks.stop()  # what was queued is delivered first
        assert [e["session_id"] for e in receiver.accepted_events()] == ["s1", "s3"]
        assert [e["session_id"] for e in other.accepted_events()] == ["s3"]
    finally:
        other.close()


async def test_stopping_cancels_delivery_and_counts_what_was_left(counts):
    stuck = Receiver()
    stuck.hang = True
    stuck.up()
    hooks = Webhooks(count=counts, timeout_s=WAIT_S, stop_grace_s=0.1)
    try:
        hooks.add_receiver(stuck.url, SECRET)
        hooks.start()
        bus = bus_for(hooks)
        for _ in range(3):
            bus.publish("session.paused", "s1", None, {})
        assert await asyncio.to_thread(stuck.hanging.wait, WAIT_S)
        async with asyncio.timeout(WAIT_S):
            await hooks.stop()  # not held up by the hanging receiver
        assert counts.outcomes == {"dropped": 3}
        assert all(r.task is not None and r.task.done() for r in hooks.receivers)
    finally:
        stuck.close()


# -- a real server -----------------------------------------------------------------------------


def test_a_server_posts_its_sessions_events_signed_with_the_secret_it_keeps(make_server, receiver):
    server = make_server(pool_size=1, webhooks=(receiver.url,))
    secret_file = Path(server.config.data_dir) / SECRET_FILE
    secret = secret_file.read_text().strip()
    assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    base = f"http://127.0.0.1:{server.http_port}"
    session_id = httpx.post(f"{base}/v1/sessions", timeout=60).json()["id"]
    httpx.delete(f"{base}/v1/sessions/{session_id}", timeout=60)
    deadline = time.monotonic() + WAIT_S
    while not any(
        e["type"] == "session.closed" and e["session_id"] == session_id
        for e in receiver.accepted_events()
    ):
        assert receiver.wait_accepted(len(receiver.accepted) + 1, deadline - time.monotonic())
    mine = [e for e in receiver.accepted_events() if e["session_id"] == session_id]
    assert [e["type"] for e in mine][0] == "session.created"
    for headers, body in receiver.accepted:
        verify(secret, headers, body)
    metrics = httpx.get(f"{base}/metrics", timeout=60).text
    assert 'cloche_webhook_deliveries_total{outcome="delivered"}' in metrics
