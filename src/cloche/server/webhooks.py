"""Webhooks: each event POSTed to the operator's URLs (and tenants'), signed as Standard
Webhooks sign (https://www.standardwebhooks.com).

The body is the event (`Event.public()` as JSON). Headers: `webhook-id` (the event's id,
the same on every attempt), `webhook-timestamp` (unix seconds of the attempt) and
`webhook-signature: v1,<base64 of HMAC-SHA256 of "<id>.<timestamp>.<body>">`, keyed with
the base64-decoded part of the secret after `whsec_`.

Delivery is at least once, in order, per receiver: a task of its own takes the receiver's
queue one event at a time and tries again after a failure (a non-2xx answer, no answer
within `TIMEOUT_S`, no connection) with exponential backoff, until `--webhook-retry-s`
after the event was published; then the event is dropped and counted, as is an event
that finds the receiver's queue full. Publishing only appends to the queues: a receiver
that hangs delays nothing but its own deliveries.

In cluster mode every front end tells the events of the nodes; an event names the receivers
this front end claimed it for (`Event.webhooks`), and only those get it from here. Each
receiver has an `id` (its URL and whose events it gets, hashed) that the front ends of a
cluster agree on without telling each other.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import httpx

from cloche import __version__
from cloche.config import ServerConfig
from cloche.errors import ConfigError
from cloche.server.events import Event

log = logging.getLogger("cloche.webhooks")

SECRET_PREFIX = "whsec_"  # noqa: S105 (the format's prefix, not a secret)
SECRET_FILE = "webhook-secret"  # noqa: S105 (in --data-dir, without --webhook-secret)
TIMEOUT_S = 10.0  # one attempt: connect, send, answer
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 60.0
STOP_GRACE_S = 5.0  # at the server's stop, receivers that answer get this long to catch up


def make_secret() -> str:
    """A new secret: `whsec_` and the base64 of 24 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


def secret_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_<base64>` secret.

    Raises:
        ValueError: not `whsec_` followed by base64 of at least one byte.
    """
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"a webhook secret starts with {SECRET_PREFIX!r}")
    try:
        key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"a webhook secret is {SECRET_PREFIX!r} and base64: {exc}") from exc
    if not key:
        raise ValueError("a webhook secret's key is empty")
    return key


def sign(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header's value for one attempt."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.digest(key, signed, hashlib.sha256)).decode()


def server_secret(given: str | None, data_dir: Path) -> str:
    """--webhook-secret, or the one kept in `<data-dir>/webhook-secret` (made, 0600, the
    first time).

    Raises:
        ConfigError: the secret given or kept is malformed, or the file can't be written.
    """
    if given is not None:
        try:
            secret_key(given)
        except ValueError as exc:
            raise ConfigError(f"--webhook-secret: {exc}") from exc
        return given
    path = data_dir / SECRET_FILE
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            kept = path.read_text().strip()
        else:
            kept = make_secret()
            with os.fdopen(fd, "w") as out:
                out.write(kept + "\n")
            log.info("webhook secret made and written to %s (0600)", path)
    except OSError as exc:
        raise ConfigError(f"can't keep the webhook secret in {path}: {exc}") from exc
    try:
        secret_key(kept)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc} (remove it to make a new one)") from exc
    return kept


class Receiver:
    """One URL, its key, whose events it gets (owner_key None: everyone's), and its queue."""

    def __init__(self, url: str, secret: str, owner_key: str | None, bound: int) -> None:
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"a webhook URL is http(s)://host/..., not {url!r}")
        self.url = url
        self.key = secret_key(secret)
        self.owner_key = owner_key
        # The same on every front end given this URL for these events (never the URL itself:
        # it may carry a token).
        self.id = hashlib.sha256(f"{url}\n{owner_key or ''}".encode()).hexdigest()[:16]
        port = f":{parsed.port}" if parsed.port else ""
        self.name = f"{parsed.scheme}://{parsed.host}{port}"  # for logs: no path, no query
        self.queue: deque[tuple[Event, float]] = deque()  # (event, its deadline, monotonic s)
        self.bound = bound
        self.ready = asyncio.Event()  # set when the queue gets an event
        self.idle = asyncio.Event()  # set while the queue is empty
        self.idle.set()
        self.failing = False  # its last attempt failed
        self.delivered = self.retried = self.dropped = 0
        self.task: asyncio.Task[None] | None = None


class Webhooks:
    """Every receiver's queue and delivery task."""

    def __init__(
        self,
        retry_s: float = 3600.0,
        queue_bound: int = 10_000,
        count: Callable[[str], None] | None = None,
        timeout_s: float = TIMEOUT_S,
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        """count: told each outcome (delivered, retried, dropped): the server's metrics."""
        self.retry_s = retry_s
        self.queue_bound = queue_bound
        self.receivers: list[Receiver] = []
        self._count = count or (lambda outcome: None)
        self._timeout_s = timeout_s
        self._stop_grace_s = stop_grace_s
        self._client: httpx.AsyncClient | None = None
        self._stopped = False

    def add_receiver(self, url: str, secret: str, owner_key: str | None = None) -> Receiver:
        """Send events to url, signed with secret (`whsec_...`): everyone's, or only those
        of the sessions of owner_key (a tenant's token hashed).

        Raises:
            ValueError: the URL is not http(s), or the secret is malformed.
        """
        receiver = Receiver(url, secret, owner_key, self.queue_bound)
        self.receivers.append(receiver)
        if self._client is not None:
            self._launch(receiver)
        return receiver

    def ids(self) -> frozenset[str]:
        """Every receiver's `id` (what a cluster front end claims events for)."""
        return frozenset(receiver.id for receiver in self.receivers)

    def offer(self, event: Event) -> None:
        """Queue the event for each receiver that wants it and that it is for (the bus's
        listener; never waits)."""
        deadline = time.monotonic() + self.retry_s
        for receiver in self.receivers:
            if receiver.owner_key is not None and event.owner_key != receiver.owner_key:
                continue
            if event.webhooks is not None and receiver.id not in event.webhooks:
                continue  # another front end of the cluster delivers it there
            if len(receiver.queue) >= receiver.bound:
                receiver.dropped += 1
                self._count("dropped")
                continue
            receiver.queue.append((event, deadline))
            receiver.ready.set()
            receiver.idle.clear()

    def start(self) -> None:
        """Start delivering (in the running event loop)."""
        if self._client is not None or self._stopped:
            return
        self._client = httpx.AsyncClient(
            timeout=self._timeout_s,
            follow_redirects=False,
            trust_env=False,  # the operator's URLs, reached directly
            headers={"user-agent": f"cloche/{__version__}"},
        )
        for receiver in self.receivers:
            self._launch(receiver)

    async def stop(self) -> None:
        """Give receivers that answer a moment to take what is queued, then stop; what is
        still queued is dropped and counted. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        catching_up = [r for r in self.receivers if r.queue and not r.failing and r.task]
        if catching_up:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._stop_grace_s):
                    await asyncio.gather(*(r.idle.wait() for r in catching_up))
        tasks = [r.task for r in self.receivers if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for receiver in self.receivers:
            if receiver.queue:
                log.warning(
                    "webhook %s: %d events not delivered at stop",
                    receiver.name,
                    len(receiver.queue),
                )
            for _ in receiver.queue:
                receiver.dropped += 1
                self._count("dropped")
            receiver.queue.clear()
        if self._client is not None:
            await self._client.aclose()

    def _launch(self, receiver: Receiver) -> None:
        receiver.task = asyncio.create_task(self._deliver_all(receiver), name="cloche-webhook")

    async def _deliver_all(self, receiver: Receiver) -> None:
        while True:
            while not receiver.queue:
                receiver.ready.clear()
                await receiver.ready.wait()
            event, deadline = receiver.queue[0]
            await self._deliver(receiver, event, deadline)
            receiver.queue.popleft()
            if not receiver.queue:
                receiver.idle.set()

    async def _deliver(self, receiver: Receiver, event: Event, deadline: float) -> None:
        """Try until delivered or deadline (monotonic s); drop it then."""
        backoff = FIRST_BACKOFF_S
        if time.monotonic() >= deadline:  # waited behind others past its time
            self._drop(receiver, event, "it waited past --webhook-retry-s")
            return
        while True:
            why = await self._attempt(receiver, event)
            if why is None:
                receiver.delivered += 1
                self._count("delivered")
                if receiver.failing:
                    receiver.failing = False
                    log.info("webhook %s answers again", receiver.name)
                return
            if not receiver.failing:
                receiver.failing = True
                log.warning("webhook %s failed (%s): retrying with backoff", receiver.name, why)
            if time.monotonic() + backoff > deadline:
                self._drop(receiver, event, why)
                return
            receiver.retried += 1
            self._count("retried")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _attempt(self, receiver: Receiver, event: Event) -> str | None:
        """Post the event once: None if the receiver took it (2xx), else why not."""
        assert self._client is not None
        body = event.json()
        message_id = str(event.id)
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "webhook-id": message_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(receiver.key, message_id, timestamp, body),
        }
        try:
            response = await self._client.post(receiver.url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if 200 <= response.status_code < 300:
            return None
        return f"answered {response.status_code}"

    def _drop(self, receiver: Receiver, event: Event, why: str) -> None:
        receiver.dropped += 1
        self._count("dropped")
        log.warning(
            "webhook %s: event %d (%s) dropped, not delivered within %g s (--webhook-retry-s): %s",
            receiver.name,
            event.id,
            event.type,
            self.retry_s,
            why,
        )


def server_webhooks(config: ServerConfig, count: Callable[[str], None] | None = None) -> Webhooks:
    """The server's webhooks: each --webhook URL, signed with the server's secret.

    Raises:
        ConfigError: a URL that is not http(s), or a malformed or unwritable secret.
    """
    webhooks = Webhooks(config.webhook_retry_s, config.events_buffer, count)
    if config.webhooks:
        secret = server_secret(config.webhook_secret, config.data_dir)
        for url in config.webhooks:
            try:
                webhooks.add_receiver(url, secret)
            except ValueError as exc:
                raise ConfigError(f"--webhook: {exc}") from exc
    return webhooks
