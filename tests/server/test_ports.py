"""Ports against real gVisor: servers started in sessions, reached through the path route
and the host route, with bodies both ways, streams, websockets, and after a pause."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from cloche.network.ports import door
from port_apps import ECHO, WEBSOCKET, start_app, wait_for_port
from support import ServerThread, make_config, require_gvisor

pytestmark = [pytest.mark.gvisor, pytest.mark.timeout(600)]
ALICE, BOB = "alice-token", "bob-token"
DOMAIN = "preview.test"
MIB = 1 << 20


@pytest.fixture(scope="module")
def served(state_root) -> Iterator[dict[str, Any]]:
    """A server with two tenants and a preview domain; alice's session A runs the echo app
    on 8000, a websocket echo on 8765 and `python3 -m http.server 8080` (on ::)."""
    require_gvisor()
    config = make_config(
        state_root, tokens=frozenset({ALICE, BOB}), preview_domain=DOMAIN, pool_size=2
    )
    with ServerThread(config) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        alice = httpx.Client(base_url=base, timeout=120, headers=_bearer(ALICE))
        bob = httpx.Client(base_url=base, timeout=120, headers=_bearer(BOB))
        anyone = httpx.Client(base_url=base, timeout=120)
        try:
            a = alice.post("/v1/sessions").json()["id"]
            start_app(alice, a, ECHO, 8000, "127.0.0.1", "A")
            start_app(alice, a, WEBSOCKET, 8765, name="ws.py")
            started = alice.post(
                f"/v1/sessions/{a}/commands",
                json={"cmd": "python3 -m http.server 8080", "background": True},
            )
            assert started.status_code == 201, started.text
            wait_for_port(alice, a, 8080)
            yield {"server": server, "alice": alice, "bob": bob, "anyone": anyone, "a": a}
        finally:
            for client in (alice, bob, anyone):
                client.close()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_dev_server_answers_through_the_path_route_and_the_host_route(served):
    alice, a = served["alice"], served["a"]
    through_path = alice.get(f"/v1/sessions/{a}/ports/8080/")
    assert through_path.status_code == 200
    assert "Directory listing" in through_path.text
    assert through_path.headers["content-security-policy"] == "sandbox"  # the API's origin
    for host in (f"8080-{a}.{DOMAIN}", f"8080-{a}.{DOMAIN}:8080", f"8080-{a}.{DOMAIN.upper()}."):
        through_host = alice.get("/", headers={"Host": host})
        assert through_host.status_code == 200, (host, through_host.text)
        assert "Directory listing" in through_host.text
        assert "content-security-policy" not in through_host.headers  # the app's own origin


def test_the_ports_listened_on_are_listed_and_a_bare_port_redirects(served):
    alice, a = served["alice"], served["a"]
    listed = alice.get(f"/v1/sessions/{a}/ports")
    assert listed.status_code == 200
    ports = [p["port"] for p in listed.json()["ports"]]
    assert {8000, 8080, 8765} <= set(ports)
    bare = alice.get(f"/v1/sessions/{a}/ports/8000?q=1")
    assert bare.status_code == 308
    assert bare.headers["location"] == f"/v1/sessions/{a}/ports/8000/?q=1"


def test_a_port_nobody_listens_on_is_a_502_naming_it_at_once(served):
    """The relay's connection is refused, and it says so: the answer waits out no deadline
    (how fast it comes is measured by benchmarks/bench_ports.py: its p99 against 1 s)."""
    alice, a = served["alice"], served["a"]
    alice.get(f"/v1/sessions/{a}/ports")  # the door is open: what is timed is the answer
    started = time.monotonic()
    refused = alice.get(f"/v1/sessions/{a}/ports/8999/")
    elapsed = time.monotonic() - started
    assert refused.status_code == 502
    assert refused.json()["error"]["type"] == "port_unreachable"
    message = refused.json()["error"]["message"]
    assert "8999" in message
    assert "nothing listens on it" in message  # the relay's ECONNREFUSED, not a timeout
    assert elapsed < door.ANSWER_TIMEOUT_S  # no deadline of the door's was waited out


def test_a_1_mib_post_round_trips_with_a_length_and_chunked(served):
    alice, a = served["alice"], served["a"]
    data = bytes(range(256)) * (4 * 1024)
    assert len(data) == MIB
    posted = alice.post(f"/v1/sessions/{a}/ports/8000/echo", content=data)
    assert posted.status_code == 200
    assert posted.content == data

    def pieces() -> Iterator[bytes]:  # no length: sent chunked, as it comes
        for start in range(0, len(data), 64 * 1024):
            yield data[start : start + 64 * 1024]

    streamed = alice.post(f"/v1/sessions/{a}/ports/8000/echo", content=pieces())
    assert streamed.status_code == 200
    assert streamed.content == data


def test_a_chunked_response_streams_before_the_app_has_finished(served):
    """The app sends its first piece and then waits for a request of the test's: the piece
    is read before that request is made, so it came while the app was still answering."""
    alice, a = served["alice"], served["a"]
    with alice.stream("GET", f"/v1/sessions/{a}/ports/8000/stream") as response:
        assert response.status_code == 200
        pieces = response.iter_bytes()
        first = next(pieces)
        assert first.startswith(b"first piece")
        released = alice.post(f"/v1/sessions/{a}/ports/8000/release", content=b"go")
        assert released.status_code == 200
        rest = first + b"".join(pieces)
    assert rest == b"first piece\nlast piece\n"


def test_a_websocket_echoes_text_and_binary_and_passes_subprotocols(served):
    server: ServerThread = served["server"]
    a = served["a"]
    url = f"ws://127.0.0.1:{server.http_port}/v1/sessions/{a}/ports/8765/"
    with ws_connect(
        url, additional_headers=_bearer(ALICE), subprotocols=["superchat", "chat"]
    ) as ws:
        assert ws.subprotocol == "chat"  # the app's choice among those offered
        ws.send("héllo")
        assert ws.recv(timeout=60) == "héllo"
        ws.send(b"\x00\x01binary\xff")
        assert ws.recv(timeout=60) == b"\x00\x01binary\xff"
        big = bytes(range(256)) * 1024
        ws.send(big)
        assert ws.recv(timeout=60) == big
        ws.send("close-me")  # the app closes with its own code and reason
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=60)
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4001, "asked to")
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=60)
    with ws_connect(f"ws://8765-{a}.{DOMAIN}/", sock=sock, additional_headers=_bearer(ALICE)) as ws:
        assert ws.subprotocol is None
        ws.send("through the host")
        assert ws.recv(timeout=60) == "through the host"


def test_the_app_sees_no_credential_and_where_it_is_served(served):
    alice, a = served["alice"], served["a"]
    token = _preview(alice, a, 8000)
    seen = served["anyone"].get(
        f"/v1/sessions/{a}/ports/8000/x?keep=1&cloche_preview={token}",
        headers={
            "Cookie": f"theirs=1; cloche_preview={token}",
            "Referer": f"http://example.com/p?cloche_preview={token}&a=b",
            "X-Forwarded-For": "6.6.6.6",
        },
    )
    assert seen.status_code == 200, seen.text
    head = seen.json()
    headers = dict(head["headers"])
    assert head["path"] == "/x?keep=1"
    assert token not in json.dumps(head)
    assert "authorization" not in headers
    assert headers["cookie"] == "theirs=1"
    assert headers["referer"] == "http://example.com/p?a=b"
    assert headers["host"] == "localhost:8000"
    assert headers["x-forwarded-prefix"] == f"/v1/sessions/{a}/ports/8000"
    assert headers["x-forwarded-for"] == "127.0.0.1"
    with_bearer = alice.get(f"/v1/sessions/{a}/ports/8000/x").json()
    assert "authorization" not in dict(with_bearer["headers"])


def test_cookies_the_app_sets_on_the_api_origin_keep_to_the_ports_path(served):
    alice, a = served["alice"], served["a"]
    answer = alice.get(f"/v1/sessions/{a}/ports/8000/cookie")
    cookies = answer.headers.get_list("set-cookie")
    assert cookies == [f"app=1; Path=/v1/sessions/{a}/ports/8000/"]  # no Domain; not ours
    on_host = alice.get("/cookie", headers={"Host": f"8000-{a}.{DOMAIN}"})
    assert on_host.headers.get_list("set-cookie") == ["app=1; Path=/; Domain=example.com"]


def test_ports_reached_before_a_pause_and_a_snapshot_answer_after_them(served):
    """The door's connections (kept alive, waiting) end before each checkpoint; the app
    comes back in the session's image, and its port answers again."""
    alice, a = served["alice"], served["a"]
    assert alice.get(f"/v1/sessions/{a}/ports/8000/x").status_code == 200
    snapshot = alice.post(f"/v1/sessions/{a}/snapshot")
    assert snapshot.status_code in (200, 201), snapshot.text
    assert alice.get(f"/v1/sessions/{a}/ports/8000/x").json()["app"] == "A"
    paused = alice.post(f"/v1/sessions/{a}/pause")
    assert paused.status_code == 200, paused.text
    assert alice.get(f"/v1/sessions/{a}").json()["state"] == "paused"
    again = alice.get(f"/v1/sessions/{a}/ports/8000/x")  # resumes it
    assert again.status_code == 200, again.text
    assert again.json()["app"] == "A"
    alice.delete(f"/v1/snapshots/{snapshot.json()['id']}")


def test_a_session_frozen_idle_after_its_ports_were_reached_still_pauses(served):
    """An idle session's sandbox is frozen (--freeze-idle); its relay, which must end its
    connections before a checkpoint, can't answer while frozen: the sandbox is thawed
    first, and the pause (the idle page-out's, the shutdown's) is saved."""
    alice, a, server = served["alice"], served["a"], served["server"]
    assert alice.get(f"/v1/sessions/{a}/ports/8000/x").status_code == 200  # the door is open
    sandbox = server.server.manager._sessions[a].kernel.sandbox

    async def freeze() -> bool:  # as the idle timer does, on the server's loop
        frozen: bool = sandbox.freeze()
        return frozen

    if not server.call(freeze()):
        pytest.skip("this host's sandboxes have no freezer cgroup")
    paused = alice.post(f"/v1/sessions/{a}/pause")
    assert paused.status_code == 200, paused.text
    assert alice.get(f"/v1/sessions/{a}").json()["state"] == "paused"
    again = alice.get(f"/v1/sessions/{a}/ports/8000/x")  # resumes it
    assert again.status_code == 200, again.text
    assert again.json()["app"] == "A"


def test_a_paused_session_s_sandbox_holds_its_kernel_and_supervisor_alone(served):
    """A session that ran a command and served a port is saved with two processes: the
    kernel and its supervisor, which serves the ports' relay itself and lets its spare
    leader go before the checkpoint (each Python process adds about its own size to the
    image: with a forked relay and a spare the paused session was 3.6x its size)."""
    alice = served["alice"]
    b = alice.post("/v1/sessions").json()["id"]
    served_in_the_kernel = (
        "import http.server, threading\n"
        "srv = http.server.ThreadingHTTPServer(\n"
        "    ('127.0.0.1', 0), http.server.SimpleHTTPRequestHandler)\n"
        "threading.Thread(target=srv.serve_forever, daemon=True).start()\n"
        "srv.server_address[1]"
    )
    ran = alice.post(f"/v1/sessions/{b}/execute", json={"code": served_in_the_kernel})
    assert ran.json()["status"] == "ok", ran.text
    port = int(ran.json()["result"]["text/plain"])
    done = alice.post(f"/v1/sessions/{b}/commands", json={"cmd": "true"})
    assert done.status_code == 200 and done.json()["exit_code"] == 0, done.text
    assert alice.get(f"/v1/sessions/{b}/ports/{port}/").status_code == 200
    paused = alice.post(f"/v1/sessions/{b}/pause")
    assert paused.status_code == 200, paused.text
    count = "import os\nlen([p for p in os.listdir('/proc') if p.isdigit()])"
    after = alice.post(f"/v1/sessions/{b}/execute", json={"code": count})  # resumes it
    assert after.json()["result"]["text/plain"] == "2", after.text
    assert alice.get(f"/v1/sessions/{b}/ports/{port}/").status_code == 200  # as before
    alice.delete(f"/v1/sessions/{b}")


def test_port_requests_are_counted(served):
    alice = served["alice"]
    metrics = alice.get("/metrics").text
    assert 'cloche_port_requests_total{kind="http",status="2xx"}' in metrics
    assert 'cloche_port_requests_total{kind="websocket",status="1xx"}' in metrics
    assert 'cloche_port_bytes_total{direction="in"}' in metrics


def _preview(client: httpx.Client, session_id: str, port: int, ttl_s: int = 600) -> str:
    made = client.post(f"/v1/sessions/{session_id}/ports/{port}/url", json={"ttl_s": ttl_s})
    assert made.status_code == 200, made.text
    url: str = made.json()["url"]
    return url.rsplit("cloche_preview=", 1)[1]
