"""One session's door out: an HTTP proxy on a unix socket that only its sandbox reaches.

Two kinds of request, as any HTTP client sends them to a proxy:
- `CONNECT host:port` opens a tunnel (https, or any TCP the policy allows): TLS runs end to
  end between the sandbox and the host named.
- `GET http://host/path` (any method, absolute URI) is forwarded as `Connection: close`,
  one request per connection, so that each request is checked on its own.
- A SOCKS5 `CONNECT` (no authentication; an address or a name) on the same socket, for TCP
  that is not HTTP (a database on a port the policy allows).

Every connection is checked (`guard`), counted against the session's limits, and ends in
one audit record. A refusal is an HTTP answer that says which host and which rule, in its
body and in `X-Cloche-Egress`; never a tunnel that opens and carries nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloche.network.door_socket import listen_at
from cloche.network.egress import guard
from cloche.network.egress.heads import (
    BadRequest,
    answer,
    destination_of,
    origin_head,
    parse_head,
    status_of,
)
from cloche.network.egress.policy import Policy
from cloche.network.egress.secrets import Substitution
from cloche.network.egress.socks import (
    SOCKS5,
    SOCKS_NOT_ALLOWED,
    SOCKS_OK,
    SOCKS_UNREACHABLE,
    socks_reply,
    socks_request,
)
from cloche.network.egress.tls import Interceptor
from cloche.network.splice import ready, splice_all

log = logging.getLogger("cloche.egress")

_BACKLOG = 100  # connections waiting to be taken (asyncio's default)
HEAD_LIMIT_BYTES = 64 * 1024  # a request line and headers larger than this are refused
HEAD_TIMEOUT_S = 30.0
CHUNK_BYTES = 1024 * 1024
READ_LIMIT_BYTES = 2 * 1024 * 1024  # read ahead of an intercepted upstream
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024  # the kernel doubles it, up to wmem_max / rmem_max

Record = dict[str, Any]


@dataclass
class Usage:
    """What one session's door has carried, against its policy's limits."""

    open_connections: int = 0
    bytes_total: int = 0
    requests: collections.deque[float] = field(default_factory=collections.deque)

    def over_rate(self, per_minute: int | None, now: float) -> bool:
        while self.requests and self.requests[0] <= now - 60:
            self.requests.popleft()
        if per_minute is not None and len(self.requests) >= per_minute:
            return True
        self.requests.append(now)
        return False


class Door:
    """The proxy of one session, listening on `path` (a unix socket in its sandbox's view).

    Args:
        session_id: whose door it is (in every record).
        owner: the session owner's tag (a token's name or hash prefix), or None.
        policy: what the session may reach.
        record: called with each audit record (the server writes and counts them).
    """

    def __init__(
        self,
        session_id: str,
        owner: str | None,
        policy: Policy,
        record: Callable[[Record], None],
        substitution: Substitution | None = None,
        interceptor: Interceptor | None = None,
    ) -> None:
        self.session_id = session_id
        self.owner = owner
        self.policy = policy
        self.substitution = substitution  # the session's placeholders, and their secrets
        self.interceptor = interceptor  # TLS for the hosts its secrets go to
        self.usage = Usage()
        self._record = record
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.path: Path | None = None

    async def open(self, path: Path) -> None:
        """Listen on path (replacing a stale socket there); the sandbox's user may connect."""
        self._server = await asyncio.start_unix_server(
            self._serve, sock=listen_at(path, _BACKLOG), limit=HEAD_LIMIT_BYTES
        )
        self.path = path

    async def close(self) -> None:
        """Stop listening and end every connection in flight."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    # -- one connection ---------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        _widen(writer)
        record: Record = {
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
            "session": self.session_id,
            "owner": self.owner,
        }
        started = time.monotonic()
        try:
            await self._exchange(reader, writer, record)
        except asyncio.CancelledError:
            record.setdefault("decision", "ended")
            record["error"] = "the session's door was closed"
        except Exception as exc:  # one connection's fault must not reach the others
            log.exception("egress: session %s: a connection failed", self.session_id)
            record.setdefault("decision", "error")
            record["error"] = str(exc)
        finally:
            writer.close()
            record["duration_ms"] = round((time.monotonic() - started) * 1000, 3)
            self._tasks.discard(task)
            self._record(record)

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: Record
    ) -> None:
        socks = False
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                first = await reader.readexactly(1)
                if first == SOCKS5:  # a SOCKS5 client (any TCP port the policy allows)
                    socks = True
                    method, forward = "SOCKS5", None
                    host, port = await socks_request(reader, writer)
                else:
                    head = first + await reader.readuntil(b"\r\n\r\n")
                    method, target, lines = parse_head(head)
                    host, port, forward = destination_of(method, target, lines)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as exc:
            record["decision"] = "bad-request"
            if not socks and (not isinstance(exc, asyncio.IncompleteReadError) or exc.partial):
                await answer(writer, 400, "Bad Request", "no complete request head", None)
            return
        except BadRequest as exc:
            record.update(decision="bad-request", error=str(exc))
            if not socks:  # a SOCKS client was answered in its own terms
                await answer(writer, 400, "Bad Request", str(exc), None)
            return
        record.update(host=host, port=port, method=method)
        try:
            self._admit(host, port)
            destination = await guard.check(self.policy, host, port)
            record["rule"] = destination.rule
            upstream, address = await guard.connect(self.policy, destination)
        except guard.Refused as exc:
            record.update(decision="refused", rule=exc.rule, reason=exc.reason)
            if socks:  # SOCKS has no room for words: the record names the rule
                writer.write(socks_reply(SOCKS_NOT_ALLOWED))
                return
            status, phrase = (
                (429, "Too Many Requests") if exc.reason == "limit" else (403, "Forbidden")
            )
            await answer(writer, status, phrase, str(exc), exc)
            return
        except guard.Unreachable as exc:
            record.update(decision="unreachable", error=str(exc))
            if socks:
                writer.write(socks_reply(SOCKS_UNREACHABLE))
                return
            await answer(writer, 502, "Bad Gateway", str(exc), None)
            return
        record.update(decision="allowed", address=str(address))
        self.usage.open_connections += 1
        streams: asyncio.StreamWriter | None = None  # over the upstream, for TLS
        try:
            substitution = self.substitution
            if forward is None and substitution and substitution.carries_secrets(host, port):
                upstream_reader, streams = await asyncio.open_connection(
                    sock=upstream, limit=READ_LIMIT_BYTES
                )
                forward = await self._intercept(reader, writer, streams, host, port, record)
                if forward is not None:
                    streams.write(forward)
                    await self._relay(reader, writer, upstream_reader, streams, record)
                return
            # Bytes the proxy does not read go from socket to socket in the kernel.
            writer.transport.set_write_buffer_limits(high=0)  # drain(): all of it sent
            if socks:
                writer.write(socks_reply(SOCKS_OK))
            elif forward is None:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            elif substitution is not None:
                forward = self._substitute(forward, host, port, record)
            await writer.drain()
            if forward is not None:
                await asyncio.get_running_loop().sock_sendall(upstream, forward)
            await self._splice(reader, writer, upstream, record, forward is not None)
        finally:
            self.usage.open_connections -= 1
            if streams is not None:
                streams.close()
            else:
                upstream.close()

    async def _intercept(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: asyncio.StreamWriter,
        host: str,
        port: int,
        record: Record,
    ) -> bytes | None:
        """TLS on both sides of a tunnel to a host that carries secrets: the head of the
        request inside, placeholders replaced (None: no request to pass on)."""
        assert self.interceptor is not None
        record["intercepted"] = True
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        try:
            await writer.start_tls(self.interceptor.server_context(host))
        except (ssl.SSLError, ConnectionError, OSError) as exc:
            record["error"] = f"the client's TLS handshake failed: {exc}"
            return None
        try:
            await upstream.start_tls(self.interceptor.upstream, server_hostname=host)
        except (ssl.SSLError, ConnectionError, OSError) as exc:
            record["error"] = f"{host}'s certificate was not accepted: {exc}"
            await answer(writer, 502, "Bad Gateway", record["error"], None)
            return None
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            method, target, lines = parse_head(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, BadRequest):
            record["error"] = "no request came through the intercepted tunnel"
            return None
        record["request"] = method
        return self._substitute(origin_head(method, target, lines, host), host, port, record)

    def _substitute(self, head: bytes, host: str, port: int, record: Record) -> bytes:
        assert self.substitution is not None
        head, replaced, leaked = self.substitution.apply(head, host, port)
        if replaced:
            record["secrets"] = replaced
        if leaked:  # a placeholder on its way to a host its secret is not for: sent as is
            record["leaked"] = leaked
            log.warning(
                "egress: session %s sent the placeholder of %s to %s:%d, which it is not "
                "for (sent unreplaced)",
                self.session_id,
                ", ".join(leaked),
                host,
                port,
            )
        return head

    def _admit(self, host: str, port: int) -> None:
        policy, usage = self.policy, self.usage
        limit = None
        if policy.max_connections is not None and usage.open_connections >= policy.max_connections:
            limit = f"max_connections {policy.max_connections} (connections open at once)"
        elif policy.max_bytes is not None and usage.bytes_total >= policy.max_bytes:
            limit = f"max_bytes {policy.max_bytes} (bytes up and down in this session)"
        elif usage.over_rate(policy.requests_per_minute, time.monotonic()):
            limit = f"requests_per_minute {policy.requests_per_minute}"
        if limit is not None:
            raise guard.Refused(host, port, f"limit of policy {policy.name!r}: {limit}", "limit")

    def _count(self, counted: dict[str, int], way: str, size: int, record: Record) -> bool:
        """Count bytes that passed; True when the session's max_bytes is now exceeded (the
        connection is to end: `counted["over"]`)."""
        counted[way] += size
        self.usage.bytes_total += size
        limit = self.policy.max_bytes
        if limit is not None and self.usage.bytes_total > limit:
            record["limit"] = f"max_bytes {limit} reached: the connection was ended"
            counted["over"] = 1
            return True
        return False

    async def _relay(
        self,
        client_reader: asyncio.StreamReader,
        client: asyncio.StreamWriter,
        upstream_reader: asyncio.StreamReader,
        upstream: asyncio.StreamWriter,
        record: Record,
    ) -> None:
        """Carry an intercepted request's bytes both ways (TLS on each side: through
        Python), until the upstream is done or the byte limit is reached."""
        counted = {"up": 0, "down": 0}

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, way: str) -> None:
            first = way == "down"
            try:
                while chunk := await source.read(CHUNK_BYTES):
                    if first:
                        record["status"] = status_of(chunk)
                        first = False
                    if self._count(counted, way, len(chunk), record):
                        return
                    sink.write(chunk)
                    await sink.drain()
                if sink.can_write_eof():
                    sink.write_eof()
            except (ConnectionError, OSError):
                pass

        await self._both_ways(
            pump(client_reader, upstream, "up"), pump(upstream_reader, client, "down"),
            counted, record,
        )  # fmt: skip

    async def _splice(
        self,
        client_reader: asyncio.StreamReader,
        client: asyncio.StreamWriter,
        upstream: socket.socket,
        record: Record,
        watch_status: bool,
    ) -> None:
        """Carry a tunnel's or a forwarded request's bytes both ways: the upstream's with
        splice(2), never through Python (a copy through Python cost the host a core per
        ~1 GiB/s, taken from the sandboxes); the client's through its reader, which may hold
        what came after the request's head."""
        counted = {"up": 0, "down": 0}
        loop = asyncio.get_running_loop()

        async def up() -> None:
            try:
                while chunk := await client_reader.read(CHUNK_BYTES):
                    if self._count(counted, "up", len(chunk), record):
                        return
                    await loop.sock_sendall(upstream, chunk)
                upstream.shutdown(socket.SHUT_WR)
            except (ConnectionError, OSError):
                pass

        async def down() -> None:
            sink = client.get_extra_info("socket")
            # The client's transport owns its descriptor: a second one, ours to watch.
            with socket.socket(fileno=os.dup(sink.fileno())) as ours:
                try:
                    if watch_status:
                        await ready(upstream.fileno(), None)
                        record["status"] = status_of(upstream.recv(512, socket.MSG_PEEK))
                    await splice_all(
                        upstream.fileno(),
                        ours.fileno(),
                        lambda size: self._count(counted, "down", size, record),
                    )
                    ours.shutdown(socket.SHUT_WR)
                except (ConnectionError, OSError):
                    pass

        await self._both_ways(up(), down(), counted, record)

    async def _both_ways(
        self,
        up: Coroutine[Any, Any, None],
        down: Coroutine[Any, Any, None],
        counted: dict[str, int],
        record: Record,
    ) -> None:
        """Run both directions until the upstream is done (its last bytes passed on, the
        client told EOF: the client may keep its end open, and HTTP requests went as
        Connection: close), or either went over the byte limit; then count what passed."""
        pumps = [asyncio.create_task(up), asyncio.create_task(down)]
        try:
            done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            if pumps[1] not in done and not counted.get("over"):
                await pumps[1]  # the client said EOF: the upstream may still answer
        finally:
            for task in pumps:
                task.cancel()
            try:
                await asyncio.gather(*pumps, return_exceptions=True)
            finally:  # counted even when the door's closing cancels this wait
                record["bytes_up"] = counted["up"]
                record["bytes_down"] = counted["down"]


def _widen(writer: asyncio.StreamWriter) -> None:
    """Give a connection's socket large kernel buffers: with the default (~200 KiB), gVisor's
    reads of the door each waited for a refill, and the door carried ~400 MiB/s, not ~3,700."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
