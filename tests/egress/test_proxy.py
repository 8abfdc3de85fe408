"""A session's door: HTTP forwarding, CONNECT tunnels, refusals, limits and records, against
test upstreams on this machine's loopback (named by address in the policies)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cloche.network.egress.policy import EgressConfig, Policy
from cloche.network.egress.proxy import Door


class Upstream:
    """An HTTP server on 127.0.0.1 that answers with what it received (or `size` bytes),
    and closes; `echo` makes it a raw echo server instead."""

    def __init__(self, echo: bool = False, size: int | None = None) -> None:
        self.echo = echo
        self.size = size
        self.heads: list[str] = []

    async def __aenter__(self) -> Upstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            if self.echo:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            else:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                self.heads.append(head)
                body = b"x" * self.size if self.size is not None else head.encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
                writer.write(body)
                await writer.drain()
        writer.close()


def policy(*allow: str, **limits: Any) -> Policy:
    config = EgressConfig.from_dict({"policies": {"p": {"allow": list(allow), **limits}}})
    return config.policies["p"]


@pytest.fixture
async def door_of(tmp_path: Path) -> AsyncIterator[Any]:
    doors: list[Door] = []
    records = Records()

    async def make(given: Policy) -> tuple[Door, Records]:
        door = Door("s1", "alice", given, records)
        await door.open(tmp_path / f"door{len(doors)}.sock")
        doors.append(door)
        return door, records

    yield make
    for door in doors:
        await door.close()


async def ask(door: Door, request: bytes) -> bytes:
    assert door.path is not None
    reader, writer = await asyncio.open_unix_connection(door.path)
    writer.write(request)
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return answer


async def tunnel(door: Door, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A CONNECT tunnel through the door, open."""
    assert door.path is not None
    reader, writer = await asyncio.open_unix_connection(door.path)
    writer.write(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    assert head == b"HTTP/1.1 200 Connection established\r\n\r\n"
    return reader, writer


class Records(list[dict[str, Any]]):
    """A door's records as they come (after it closed its side of each connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    def __call__(self, record: dict[str, Any]) -> None:
        self.append(record)
        self.changed.set()


async def settled(records: Records, count: int) -> None:
    async with asyncio.timeout(30):
        while len(records) < count:
            records.changed.clear()
            await records.changed.wait()


async def test_http_is_forwarded_in_origin_form_without_proxy_headers(door_of: Any) -> None:
    async with Upstream() as upstream:
        door, records = await door_of(policy(f"127.0.0.1:{upstream.port}"))
        answer = await ask(
            door,
            f"GET http://127.0.0.1:{upstream.port}/data?x=1 HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{upstream.port}\r\nProxy-Authorization: Basic eA==\r\n"
            "Proxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n".encode(),
        )
        await settled(records, 1)
    assert answer.startswith(b"HTTP/1.1 200 OK")
    (head,) = upstream.heads
    assert head.startswith("GET /data?x=1 HTTP/1.1\r\n")
    assert "Proxy-" not in head and "Connection: close" in head and "Accept: */*" in head
    (record,) = records
    assert record["decision"] == "allowed" and record["status"] == 200
    assert record["rule"] == f"allow 127.0.0.1:{upstream.port}"
    assert record["session"] == "s1" and record["owner"] == "alice"
    assert record["time"].endswith("+00:00") and record["duration_ms"] >= 0
    assert record["address"] == "127.0.0.1" and record["method"] == "GET"
    assert record["bytes_up"] == 0 and record["bytes_down"] == len(answer)


async def test_connect_opens_a_tunnel_that_carries_both_ways(door_of: Any) -> None:
    async with Upstream(echo=True) as upstream:
        door, records = await door_of(policy(f"127.0.0.1:{upstream.port}"))
        reader, writer = await tunnel(door, upstream.port)
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        writer.write_eof()
        assert await reader.read() == b""
        writer.close()
        await settled(records, 1)
    assert records[0]["method"] == "CONNECT" and records[0]["bytes_up"] == 4


@pytest.mark.parametrize(
    ("request_line", "rule"),
    [
        ("GET http://example.com/ HTTP/1.1", "no allow rule of policy 'p' names this name"),
        ("CONNECT 169.254.169.254:80 HTTP/1.1", "names this address"),
        ("CONNECT allowed.example.com:8443 HTTP/1.1", "names this name"),  # a denied port
        ("CONNECT localhost:{port} HTTP/1.1", "resolves to 127.0.0.1, a loopback address"),
        ("CONNECT 127.0.0.2:{port} HTTP/1.1", "names this address"),
        ("CONNECT 127.0.0.1:{port} HTTP/1.1", "names this address"),  # named on another port
    ],
)
async def test_refusals_name_the_host_and_the_rule(
    door_of: Any, request_line: str, rule: str
) -> None:
    async with Upstream() as upstream:
        other = 1 + upstream.port % 60000  # 127.0.0.1 is named, on another port
        door, records = await door_of(
            policy(f"localhost:{upstream.port}", f"127.0.0.1:{other}", "allowed.example.com:443")
        )
        line = request_line.format(port=upstream.port)
        answer = (await ask(door, f"{line}\r\nHost: x\r\n\r\n".encode())).decode()
        await settled(records, 1)
    head, _, body = answer.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 403 Forbidden")
    assert rule in body and "refused" in body
    (egress,) = [h for h in head.split("\r\n") if h.startswith("X-Cloche-Egress:")]
    assert "refused;" in egress and rule.split(",")[0] in egress
    assert records[0]["decision"] == "refused" and rule in records[0]["rule"]
    assert upstream.heads == []  # nothing reached it


async def test_bad_requests_get_400_with_a_reason(door_of: Any) -> None:
    door, records = await door_of(policy("example.com"))
    for request, reason in (
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"send it absolute http:// URLs"),
        (b"hello there\r\n\r\n", b"not an HTTP/1.x request line"),
        (b"CONNECT example.com HTTP/1.1\r\n\r\n", b"CONNECT wants host:port"),
        (b"CONNECT example.com:99999 HTTP/1.1\r\n\r\n", b"out of range"),
        (b"GET http://x/" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", b"no complete request head"),
    ):
        answer = await ask(door, request)
        assert answer.startswith(b"HTTP/1.1 400 Bad Request"), answer[:80]
        assert reason in answer
    await settled(records, 5)
    assert {r["decision"] for r in records} == {"bad-request"}


async def test_connections_over_the_limit_are_refused_and_the_door_goes_on(door_of: Any) -> None:
    async with Upstream(echo=True) as upstream:
        door, records = await door_of(policy(f"127.0.0.1:{upstream.port}", max_connections=1))
        _, writer = await tunnel(door, upstream.port)
        second = await ask(door, f"CONNECT 127.0.0.1:{upstream.port} HTTP/1.1\r\n\r\n".encode())
        assert second.startswith(b"HTTP/1.1 429 Too Many Requests")
        assert b"max_connections 1" in second
        writer.close()
        await settled(records, 2)
        _, third = await tunnel(door, upstream.port)  # the first one's place is free again
        third.close()


async def test_a_session_over_its_bytes_is_cut_off_and_then_refused(door_of: Any) -> None:
    async with Upstream(size=1_000_000) as upstream:
        door, records = await door_of(policy(f"127.0.0.1:{upstream.port}", max_bytes=100_000))
        url = f"http://127.0.0.1:{upstream.port}/big"
        answer = await ask(door, f"GET {url} HTTP/1.1\r\n\r\n".encode())
        assert len(answer) <= 100_000
        await settled(records, 1)
        assert "max_bytes 100000 reached" in records[0]["limit"]
        again = await ask(door, f"GET {url} HTTP/1.1\r\n\r\n".encode())
    assert again.startswith(b"HTTP/1.1 429") and b"max_bytes 100000" in again


async def test_closing_the_door_ends_its_connections(door_of: Any) -> None:
    async with Upstream(echo=True) as upstream:
        door, records = await door_of(policy(f"127.0.0.1:{upstream.port}"))
        reader, writer = await tunnel(door, upstream.port)
        await door.close()
        assert await asyncio.wait_for(reader.read(), 30) == b""
        writer.close()
        assert door.path is not None and not door.path.exists()
    assert records[0]["error"] == "the session's door was closed"


async def socks(door: Door, address: bytes, port: int) -> tuple[bytes, Any, Any]:
    """A SOCKS5 CONNECT through the door: (the reply, reader, writer)."""
    assert door.path is not None
    reader, writer = await asyncio.open_unix_connection(door.path)
    writer.write(b"\x05\x01\x00")
    assert await reader.readexactly(2) == b"\x05\x00"
    writer.write(b"\x05\x01\x00" + address + port.to_bytes(2, "big"))
    return await asyncio.wait_for(reader.readexactly(10), 30), reader, writer


async def test_socks5_connects_where_the_policy_allows(door_of: Any) -> None:
    async with Upstream(echo=True) as upstream:
        door, records = await door_of(policy(f"127.0.0.1:{upstream.port}"))
        reply, reader, writer = await socks(door, b"\x01\x7f\x00\x00\x01", upstream.port)
        assert reply[:2] == b"\x05\x00"
        writer.write(b"select 1")
        assert await reader.readexactly(8) == b"select 1"
        writer.close()
        refused, _, other = await socks(door, b"\x01\x7f\x00\x00\x01", upstream.port + 1)
        assert refused[:2] == b"\x05\x02"  # not allowed by the ruleset
        other.close()
        named, _, third = await socks(door, b"\x03\x09localhost", upstream.port)
        assert named[:2] == b"\x05\x02"  # a name no name rule allows
        third.close()
        await settled(records, 3)
    assert [r["method"] for r in records] == ["SOCKS5"] * 3
    (allowed,) = [r for r in records if r["decision"] == "allowed"]
    assert allowed["bytes_up"] == 8
    assert {r.get("reason") for r in records if r is not allowed} == {"not-allowed"}


async def test_socks5_without_its_method_or_with_another_command_is_refused(
    door_of: Any,
) -> None:
    door, records = await door_of(policy("example.com"))
    assert await ask(door, b"\x05\x01\x02") == b"\x05\xff"  # only username/password offered
    bound = await ask(door, b"\x05\x01\x00\x05\x02\x00\x01\x7f\x00\x00\x01\x00\x50")
    assert bound[:2] == b"\x05\x00" and bound[2:4] == b"\x05\x07"  # BIND: not served
    await settled(records, 2)
    assert {r["decision"] for r in records} == {"bad-request"}
