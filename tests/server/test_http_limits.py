"""A request body over --max-frame-bytes, sent whole before the client reads anything, is
answered 413: the server reads and drops it (up to a bound), so the client gets the answer
rather than a connection reset. Against a real gVisor server."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from cloche.server.http.limits import DRAIN_MAX_BYTES
from support import ServerThread, make_config, require_gvisor

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def small(state_root) -> Iterator[ServerThread]:
    require_gvisor()
    with ServerThread(make_config(state_root, pool_size=1, max_frame_bytes=LIMIT)) as running:
        yield running


def send_whole(port: int, path: str, body: bytes) -> bytes:
    """Send the request and all of its body, then read the answer to its end."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as client:
        client.sendall(head + body)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("size", [LIMIT + 1, 16 * LIMIT])
def test_a_body_over_the_limit_sent_whole_gets_413(small: ServerThread, size: int) -> None:
    assert size < DRAIN_MAX_BYTES
    for path in ("/v1/sessions", "/"):
        answer = send_whole(small.http_port, path, b"x" * size)
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert b"max-frame-bytes" in answer
    # The server is fine afterwards.
    ok = send_whole(small.http_port, "/", b'{"code": "6 * 7"}')
    assert ok.startswith(b"HTTP/1.1 200 ") and b'"final_expression":42' in ok
