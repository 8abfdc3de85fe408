"""The sandbox's end of the door (`cloche.kernel.egress`), run here on the host against a real
door: bytes both ways through splice, the EOF passed on, connections dropped before a
checkpoint, and a closed door answered with a 502 (the real-gVisor path is in
test_egress_sessions.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloche.kernel import egress as inside
from cloche.network.egress.proxy import Door

from .test_proxy import Records, Upstream, policy

MIB = 1 << 20


@contextlib.contextmanager
def relay_to(door: Path) -> Iterator[tuple[inside._Relay, int]]:
    """A relay on a free port of 127.0.0.1 to the door (through its directory's descriptor:
    the door's path is longer than a unix socket's address may be)."""
    directory = os.open(door.parent, os.O_RDONLY | os.O_DIRECTORY)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    relay = inside._Relay(listener, f"/proc/self/fd/{directory}/{door.name}")
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        yield relay, listener.getsockname()[1]
    finally:
        relay.stop()
        thread.join(10)
        os.close(directory)
        assert not thread.is_alive()


def tunnel(port: int, to: int) -> tuple[socket.socket, bytes]:
    """A CONNECT through the relay; the socket and the proxy's answer head."""
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    client.sendall(b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: x\r\n\r\n" % to)
    head = b""
    while b"\r\n\r\n" not in head:
        piece = client.recv(1)
        assert piece, head
        head += piece
    return client, head


def receive_all(sock: socket.socket) -> bytes:
    got = bytearray()
    while piece := sock.recv(MIB):
        got += piece
    return bytes(got)


def ended(sock: socket.socket) -> bytes:
    """What a dropped connection still gives: nothing, then an EOF or a reset."""
    try:
        return receive_all(sock)
    except ConnectionResetError:
        return b""


@pytest.fixture
def deep(tmp_path: Path) -> Path:
    directory = tmp_path / ("d" * 60) / ("e" * 60)
    directory.mkdir(parents=True)
    return directory / "door.sock"


async def test_a_tunnel_carries_16_mib_each_way_and_its_eof(deep: Path) -> None:
    assert len(str(deep)) > 108  # more than sun_path holds: the door binds it all the same
    records = Records()
    async with Upstream(echo=True) as upstream:
        door = Door("s1", "alice", policy(f"127.0.0.1:{upstream.port}"), records)
        await door.open(deep)
        payload = os.urandom(16 * MIB)

        def exchange(port: int) -> tuple[bytes, bytes]:
            client, head = tunnel(port, upstream.port)
            sender = threading.Thread(
                target=lambda: (client.sendall(payload), client.shutdown(socket.SHUT_WR))
            )
            sender.start()
            echoed = receive_all(client)  # ends at the EOF the upstream sent after ours
            sender.join()
            client.close()
            return head, echoed

        try:
            with relay_to(deep) as (_relay, port):
                head, echoed = await asyncio.to_thread(exchange, port)
        finally:
            await door.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    assert len(echoed) == len(payload) and echoed == payload
    assert [r["decision"] for r in records] == ["allowed"], records
    assert records[0]["bytes_up"] == records[0]["bytes_down"] == len(payload)


async def test_dropped_connections_end_and_a_closed_door_is_a_502(deep: Path) -> None:
    async with Upstream(echo=True) as upstream:
        door = Door("s1", "alice", policy(f"127.0.0.1:{upstream.port}"), Records())
        await door.open(deep)
        with relay_to(deep) as (relay, port):

            def dropped() -> tuple[int, bytes, int]:
                held = [tunnel(port, upstream.port)[0] for _ in range(2)]
                for client in held:  # both carry bytes ...
                    client.sendall(b"ping")
                    assert client.recv(4) == b"ping"
                count = relay.drop(10)
                rest = b"".join(ended(client) for client in held)  # ... then end
                for client in held:
                    client.close()
                return count, rest, relay.drop(10)

            count, rest, again = await asyncio.to_thread(dropped)
            assert (count, rest, again) == (2, b"", 0)
            await door.close()

            def refused() -> bytes:
                with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
                    client.sendall(b"CONNECT 127.0.0.1:1 HTTP/1.1\r\n\r\n")
                    return receive_all(client)

            answer = await asyncio.to_thread(refused)
    assert answer.startswith(b"HTTP/1.1 502"), answer
    assert b"egress door is closed" in answer
