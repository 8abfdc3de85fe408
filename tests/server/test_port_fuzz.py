"""The port routes fuzzed with raw requests (hypothesis): whatever comes in, cloche answers
it itself with one of its refusals, or the app in the session answers; never a server error
of cloche's own (a 500 of an exception in its code), and the server is well afterwards.
(The API's operations are fuzzed from their schema in test_http_schema.py; a port route is
the app's surface, not in it.)"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from port_apps import ECHO, start_app
from support import ServerThread, make_config, require_gvisor

pytestmark = [pytest.mark.gvisor, pytest.mark.timeout(900)]
DOMAIN = "preview.test"
OURS = {"port_unreachable", "unauthorized", "not_found", "invalid_request", "forbidden"}


@pytest.fixture(scope="module")
def served(state_root) -> Iterator[dict[str, Any]]:
    require_gvisor()
    with ServerThread(make_config(state_root, preview_domain=DOMAIN)) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        with httpx.Client(base_url=base, timeout=120) as http:
            session_id = http.post("/v1/sessions").json()["id"]
            start_app(http, session_id, ECHO, 8000, "127.0.0.1", "A")
            yield {"server": server, "http": http, "session_id": session_id}


def _exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


text = st.text(st.characters(codec="latin-1", exclude_characters="\r\n"), max_size=40)
segment = st.one_of(text.map(lambda t: t.replace(" ", "%20")), st.sampled_from(["..", ".", ""]))


@st.composite
def requests(draw: st.DrawFn, session_id: str) -> bytes:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH",
                                   "X-ODD", "CONNECT", "TRACE"]))  # fmt: skip
    port = draw(st.sampled_from(["8000", "8001", "0", "65536", "99999999", "8000x", "-1"]))
    tail = "/".join(draw(st.lists(segment, max_size=4)))
    query = draw(st.sampled_from(["", "?a=1", "?cloche_preview=x.y", "?" + draw(text)]))
    if draw(st.booleans()):
        host, path = f"{port}-{session_id}.{DOMAIN}", f"/{tail}{query}"
    else:
        host, path = "127.0.0.1", f"/v1/sessions/{session_id}/ports/{port}/{tail}{query}"
    headers = draw(st.lists(st.tuples(text, text), max_size=4))
    body = draw(st.binary(max_size=64))
    head = [f"{method} {path.replace(' ', '%20') or '/'} HTTP/1.1", f"Host: {host}"]
    head += [f"{name}: {value}" for name, value in headers]
    framing = draw(st.sampled_from(["length", "chunked", "none"]))
    if framing == "length":
        head.append(f"Content-Length: {len(body)}")
    elif framing == "chunked":
        head.append("Transfer-Encoding: chunked")
        body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    else:
        body = b""
    head.append("Connection: close")
    return "\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + body


def test_no_request_to_a_port_route_makes_a_server_error(served):
    server: ServerThread = served["server"]

    @settings(
        max_examples=80,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(data=requests(served["session_id"]))
    def fuzz(data: bytes) -> None:
        answer = _exchange(server.http_port, data)
        if not answer:
            return  # a request the front end could not read: it closed the connection
        head, _, body = answer.partition(b"\r\n\r\n")
        assert body != b"Internal Server Error", answer  # uvicorn's, for an app that raised
        if body.startswith(b'{"error"'):  # cloche's own answer: one of its refusals
            assert json.loads(body)["error"]["type"] in OURS, answer
        else:  # the app's answer (its own errors too), or the front end's 4xx for bad input
            assert not head.startswith(b"HTTP/1.1 5") or b"\r\nx-app-name" not in head, answer

    fuzz()
    assert served["http"].get("/health").status_code == 200
    again = served["http"].get(f"/v1/sessions/{served['session_id']}/ports/8000/x")
    assert again.headers["x-app-name"] == "A"
