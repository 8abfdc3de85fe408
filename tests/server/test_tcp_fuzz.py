"""Property-based fuzzing of the TCP front end: whatever arrives, the server answers clearly,
never crashes or hangs, and other connections are unaffected."""

from __future__ import annotations

import json
import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloche.client.tcp import TCPClient

FUZZ = settings(
    max_examples=1500,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
MAX_FRAME = 1 << 20


@pytest.fixture(scope="module")
def fuzzed(state_root):
    from support import ServerThread, make_config, require_gvisor

    require_gvisor()
    config = make_config(state_root, pool_size=1, max_frame_bytes=MAX_FRAME)
    with ServerThread(config) as running:
        with running.client() as bystander:
            sid = bystander.run("n = 0")["session_id"]
            running.bystander = (bystander, sid)  # type: ignore[attr-defined]
            yield running


def exchange(port: int, data: bytes) -> list[dict[str, object]]:
    """Send raw bytes, close our side, and read every reply frame until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    replies = []
    while received:
        (length,) = struct.unpack(">I", received[:4])
        replies.append(json.loads(received[4 : 4 + length]))
        received = received[4 + length :]
    return replies


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def check_bystander(server) -> None:
    client, sid = server.bystander
    assert client.run("n += 1; 'ok'", sid)["output"] == "'ok'\n"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)
# Requests whose fields have any JSON type; code, when a string, never reaches a sandbox
# because the session id is unknown (or a type is wrong).
requests = st.fixed_dictionaries(
    {},
    optional={
        "code": json_values,
        "session_id": st.one_of(json_values, st.just("f" * 32)),
        "timeout": json_values,
        "token": json_values,
    },
).filter(lambda r: not (isinstance(r.get("code"), str) and not r.get("session_id")))


@FUZZ
@given(body=st.binary(max_size=200))
def test_random_bodies_get_a_clear_error_and_the_connection_stays_usable(fuzzed, body):
    replies = exchange(fuzzed.tcp_port, frame(body) + frame(b'{"code": "1", "session_id": "x"}'))
    assert replies[0]["status"] == "ok"  # greeting
    assert len(replies) == 3
    assert replies[1]["status"] == "error"
    assert replies[2] == {"status": "error", "error": "Session x not found"}


@FUZZ
@given(request=requests)
def test_requests_of_any_shape_get_an_answer(fuzzed, request):
    replies = exchange(fuzzed.tcp_port, frame(json.dumps(request).encode()))
    assert len(replies) == 2
    assert replies[1]["status"] == "error"
    assert isinstance(replies[1]["error"], str) and replies[1]["error"]


@FUZZ
@given(data=st.binary(max_size=64))
def test_truncated_and_random_streams_never_hang_or_crash(fuzzed, data):
    replies = exchange(fuzzed.tcp_port, data)
    assert replies and replies[0]["status"] == "ok"
    assert all(r["status"] in ("ok", "error") for r in replies)


@FUZZ
@given(length=st.integers(min_value=MAX_FRAME + 1, max_value=2**32 - 1))
def test_huge_declared_lengths_are_refused_then_closed(fuzzed, length):
    replies = exchange(fuzzed.tcp_port, struct.pack(">I", length) + b"{}")
    assert len(replies) == 2
    assert "too large" in str(replies[1]["error"])


def test_other_connections_and_sessions_are_unaffected_by_the_fuzzing(fuzzed):
    check_bystander(fuzzed)
    with TCPClient("127.0.0.1", fuzzed.tcp_port) as c:
        assert c.run("2 + 2")["output"] == "4\n"


def test_connections_beyond_the_cap_get_an_error(make_server):
    capped = make_server(max_connections=2, pool_size=0)
    with capped.client(), capped.client():
        with socket.create_connection(("127.0.0.1", capped.tcp_port), timeout=10) as third:
            (length,) = struct.unpack(">I", third.recv(4, socket.MSG_WAITALL))
            reply = json.loads(third.recv(length, socket.MSG_WAITALL))
            assert reply["status"] == "error"
            assert "limit of 2 connections" in reply["error"]
            assert third.recv(1) == b""
