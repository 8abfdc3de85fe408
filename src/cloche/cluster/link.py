"""The data path: one TCP connection from a front end to a node agent, many requests on it.

Ray carries the control (placement, discovery, health, images); cells go straight to the
agent over this link, framed as the TCP protocol is (4-byte length + JSON)::

    front end -> agent   {"hello": SECRET}                       once, first
    agent -> front end   {"hello": "ok", "node": ID, ...}         and the agent's greeting
    front end -> agent   {"id": N, "op": NAME, "args": {...}}     a request
    front end -> agent   {"id": N, "cancel": true}                the caller gave up
    agent -> front end   {"id": N, "event": {...}}                a cell's output, as it happens
    agent -> front end   {"id": N, "ok": VALUE} | {"id": N, "error": {"type", "message", ...}}

The front end sends a heartbeat request HEARTBEAT_S after each answer; a link that answers
nothing at all (no heartbeat, no other reply, nothing else the front end heard from its
agent: `heard`) for its deadline (--node-deadline), or whose connection ends, is down for
good (its node is declared dead: a node that comes back later is not trusted again). A
starved machine's agent answers late, not never: the deadline outlasts what was measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import itertools
import logging
import socket
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from cloche.cluster import codec
from cloche.cluster.tls import node_name
from cloche.errors import ClocheError, ProtocolError
from cloche.protocol.framing import decode_body, encode_frame, read_body
from cloche.sessions.kernel import EventCallback

log = logging.getLogger("cloche.cluster")

MAX_FRAME_BYTES = 1 << 30  # a frame carries at most one file of a working directory, base64
HEARTBEAT_S = 0.5
# No answer for this long: the node is dead, for good (the default of --node-deadline, and
# why it is 30 s: `ServerConfig.node_deadline_s`). A killed agent is seen at once (its
# connection ends); this is for a machine that froze, and must not mistake a loaded one.
DEADLINE_S = 30.0
ROUND_TRIPS_KEPT = 8  # the last heartbeats' round trips, told when a node is declared dead
CONNECT_TIMEOUT_S = 5.0

Handler = Callable[[str, dict[str, Any], EventCallback], Awaitable[Any]]


class LinkDown(ClocheError):
    """The node agent at the other end can't be reached any more."""


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _forget(running: dict[int, asyncio.Task[None]], number: int, _: object) -> None:
    running.pop(number, None)


class AgentServer:
    """The agent's end: answers requests from front ends that know the cluster's secret."""

    def __init__(
        self,
        node_id: str,
        secret: str,
        handler: Handler,
        greeting: Callable[[], dict[str, Any]] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """greeting: what a front end is told with the hello (as the connection opens).
        tls: the agent's side of mutual TLS (`cluster.tls.AgentTLS`); None only in unit
        tests of the framing."""
        self.node_id = node_id
        self._tls = tls
        self._secret = secret
        self._handler = handler
        self._greeting = greeting
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(
            self._serve,
            host,
            port,
            limit=1 << 20,
            reuse_address=True,
            ssl=self._tls,
            ssl_handshake_timeout=CONNECT_TIMEOUT_S if self._tls is not None else None,
        )
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        _no_delay(writer)
        running: dict[int, asyncio.Task[None]] = {}
        try:
            hello = await asyncio.wait_for(read_body(reader, 4096), CONNECT_TIMEOUT_S)
            offered = decode_body(hello).get("hello") if hello is not None else None
            if not isinstance(offered, str) or not hmac.compare_digest(offered, self._secret):
                log.warning("a data-path connection without the cluster's secret was refused")
                return
            greeting = self._greeting() if self._greeting is not None else {}
            writer.write(encode_frame({**greeting, "hello": "ok", "node": self.node_id}))
            while (body := await read_body(reader, MAX_FRAME_BYTES)) is not None:
                message = decode_body(body)
                number = message.get("id")
                if not isinstance(number, int):
                    continue
                if message.get("cancel"):
                    if (pending := running.get(number)) is not None:
                        pending.cancel()
                    continue
                request = asyncio.create_task(self._answer(writer, number, message))
                running[number] = request
                request.add_done_callback(functools.partial(_forget, running, number))
        except (ProtocolError, OSError, TimeoutError) as exc:
            log.info("data-path connection closed: %s", exc)
        except asyncio.CancelledError:
            # The server is closing (`close`): ended here, as asyncio's streams would
            # otherwise log the cancelled connection task as an error.
            pass
        finally:
            for request in running.values():
                request.cancel()  # the front end went away: its cells are given up
            writer.close()
            self._connections.discard(task)

    async def _answer(self, writer: asyncio.StreamWriter, number: int, message: Any) -> None:
        def send_event(event: dict[str, Any]) -> None:
            if not writer.is_closing():
                writer.write(encode_frame({"id": number, "event": event}))

        try:
            op, args = str(message.get("op")), message.get("args") or {}
            value = await self._handler(op, args, send_event)
            reply: dict[str, Any] = {"id": number, "ok": value}
        except ClocheError as exc:
            reply = {"id": number, "error": codec.error_out(exc)}
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not take the connection down
            log.exception("data-path request %s failed", message.get("op"))
            reply = {"id": number, "error": {"type": "ClocheError", "message": repr(exc)}}
        if not writer.is_closing():
            writer.write(encode_frame(reply))
            with contextlib.suppress(ConnectionError):
                await writer.drain()


class AgentLink:
    """A front end's end: requests to one node agent, and whether it still answers."""

    def __init__(
        self,
        node_id: str,
        host: str,
        port: int,
        secret: str,
        on_down: Callable[[AgentLink, str], None],
        on_stats: Callable[[AgentLink, dict[str, Any]], None],
        tls: ssl.SSLContext | None = None,
        deadline_s: float | None = None,
    ) -> None:
        """tls: the front end's side of mutual TLS (`cluster.tls.front_end_context`): the
        agent must show the certificate of node_id. None only in unit tests. deadline_s:
        how long it may answer nothing before it is down (--node-deadline; DEADLINE_S)."""
        self.node_id = node_id
        self.deadline_s = DEADLINE_S if deadline_s is None else deadline_s
        self.heard_at = time.monotonic()  # when its agent last answered anything
        self.round_trips: deque[float] = deque(maxlen=ROUND_TRIPS_KEPT)  # heartbeats', s
        self._tls = tls
        self.host = host
        self.port = port
        self._secret = secret
        self._on_down = on_down
        self._on_stats = on_stats
        self.down: str | None = None  # why it went down, once it has
        self.greeting: dict[str, Any] = {}  # what the agent said with its hello
        self._numbers = itertools.count(1)
        self._waiting: dict[int, tuple[asyncio.Future[Any], EventCallback | None]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def connect(self) -> None:
        """Open the connection and start listening and heartbeating. Raises LinkDown."""
        try:
            secure: dict[str, Any] = {}
            if self._tls is not None:
                secure = {"ssl": self._tls, "server_hostname": node_name(self.node_id)}
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, limit=1 << 20, **secure),
                CONNECT_TIMEOUT_S,
            )
            _no_delay(writer)
            writer.write(encode_frame({"hello": self._secret}))
            body = await asyncio.wait_for(read_body(reader, 4096), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError, ProtocolError) as exc:  # ssl.SSLError is an OSError
            raise LinkDown(f"node {self.node_id} at {self.host}:{self.port}: {exc}") from exc
        hello = decode_body(body) if body is not None else {}
        if hello.get("hello") != "ok":
            writer.close()
            raise LinkDown(f"node {self.node_id} refused the cluster's secret")
        self.greeting = hello
        self.heard_at = time.monotonic()
        self._writer = writer
        self._tasks = [
            asyncio.create_task(self._listen(reader), name=f"link-{self.node_id}"),
            asyncio.create_task(self._heartbeat(), name=f"heartbeat-{self.node_id}"),
        ]

    async def call(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        on_event: EventCallback | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """One request; its answer, or the agent's error raised here.

        Raises:
            LinkDown: the agent can't be reached, or went away before answering.
        """
        if self.down is not None or self._writer is None:
            raise LinkDown(f"node {self.node_id} is down: {self.down}")
        number = next(self._numbers)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[number] = (answer, on_event)
        try:
            self._writer.write(encode_frame({"id": number, "op": op, "args": args or {}}))
            return await asyncio.wait_for(answer, timeout_s)
        except asyncio.CancelledError:
            if self.down is None and not self._writer.is_closing():
                self._writer.write(encode_frame({"id": number, "cancel": True}))
            raise
        finally:
            self._waiting.pop(number, None)

    def close(self, why: str = "closed") -> None:
        """Stop using the link; whatever waits on it fails with LinkDown."""
        if self.down is not None:
            return
        self.down = why
        for answer, _ in list(self._waiting.values()):
            if not answer.done():
                answer.set_exception(LinkDown(f"node {self.node_id} went down: {why}"))
        self._waiting.clear()
        if self._writer is not None:
            self._writer.close()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    def heard(self) -> None:
        """Its agent answered the front end another way (a drain's call over Ray): alive."""
        self.heard_at = time.monotonic()

    def _fail(self, why: str) -> None:
        if self.down is None:
            log.warning("node %s is down: %s", self.node_id, why)
            self.close(why)
            self._on_down(self, why)

    async def _listen(self, reader: asyncio.StreamReader) -> None:
        why = "its connection closed"
        try:
            while (body := await read_body(reader, MAX_FRAME_BYTES)) is not None:
                self.heard_at = time.monotonic()
                message = decode_body(body)
                waiting = self._waiting.get(message.get("id"))  # type: ignore[arg-type]
                if waiting is None:
                    continue  # the caller gave up
                answer, on_event = waiting
                if "event" in message:
                    if on_event is not None:
                        on_event(message["event"])
                elif answer.done():
                    continue
                elif "error" in message:
                    answer.set_exception(codec.error_in(message["error"]))
                else:
                    answer.set_result(message.get("ok"))
        except (ProtocolError, OSError) as exc:
            why = f"its connection broke: {exc}"
        self._fail(why)

    async def _heartbeat(self) -> None:
        while self.down is None:
            began = time.monotonic()
            try:
                stats = await self.call("stats", timeout_s=self.deadline_s)
            except TimeoutError:
                silent_s = time.monotonic() - self.heard_at
                if silent_s < self.deadline_s:
                    continue  # it answered something else meanwhile: slow, not gone
                trips = ", ".join(f"{trip:.2f}" for trip in self.round_trips)
                self._fail(
                    f"no answer for {silent_s:.1f} s (--node-deadline {self.deadline_s:g} s; "
                    + (f"its last heartbeats took {trips} s)" if trips else "no heartbeat yet)")
                )
                return
            except LinkDown:
                return
            self.round_trips.append(time.monotonic() - began)
            self._on_stats(self, stats)
            await asyncio.sleep(HEARTBEAT_S)
