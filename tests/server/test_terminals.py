"""Terminals of a session over the pty websocket, against real gVisor: typed input and its
answer, a resize the terminal follows, several at once, and nothing left behind when the
socket closes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from support import ServerThread, make_config, require_gvisor

T1 = {"Authorization": "Bearer t1"}


@pytest.fixture(scope="module")
def server(state_root) -> Iterator[ServerThread]:
    require_gvisor()
    with ServerThread(make_config(state_root, tokens=frozenset({"t1", "t2"}))) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    base = f"http://127.0.0.1:{server.http_port}"
    with httpx.Client(base_url=base, headers=T1, timeout=120) as client:
        yield client


@pytest.fixture
def session(http: httpx.Client) -> Iterator[str]:
    reply = http.post("/v1/sessions", json={})
    assert reply.status_code == 201, reply.text
    yield reply.json()["id"]
    http.delete(f"/v1/sessions/{reply.json()['id']}")


def terminal(
    server: ServerThread, session: str, query: str = "", headers: dict[str, str] = T1
) -> ClientConnection:
    url = f"ws://127.0.0.1:{server.http_port}/v1/sessions/{session}/pty{query}"
    return connect(url, additional_headers=headers, open_timeout=60)


def read_until(ws: ClientConnection, wanted: bytes, timeout_s: float = 60.0) -> bytes:
    """The terminal's bytes until wanted appears (a shell echoes what is typed, and its
    answer comes after: look for what only the answer holds)."""
    seen = b""
    deadline = time.monotonic() + timeout_s
    while wanted not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{wanted!r} not seen in {seen[-2000:]!r}"
        frame = ws.recv(timeout=left)
        if isinstance(frame, bytes):
            seen += frame
    return seen


def shells(http: httpx.Client, session: str) -> list[str]:
    listed = http.get(f"/v1/sessions/{session}/commands")
    assert listed.status_code == 200, listed.text
    return [c["cmd"] for c in listed.json()["commands"]]


def test_a_typed_command_is_answered(server, session):
    with terminal(server, session) as ws:
        ws.send(b"echo $((6*7))X\r")
        assert b"42X" in read_until(ws, b"42X")


def test_stty_follows_a_resize(server, session):
    with terminal(server, session, "?cols=100&rows=30") as ws:
        ws.send(b"stty size\r")
        read_until(ws, b"30 100")
        ws.send(json.dumps({"resize": {"cols": 132, "rows": 43}}))
        ws.send(b"stty size\r")
        read_until(ws, b"43 132")


def test_several_terminals_at_once_and_none_left_when_closed(server, http, session):
    with terminal(server, session) as one, terminal(server, session) as two:
        one.send(b"echo one-$((1+1))\r")
        two.send(b"echo two-$((2+2))\r")
        read_until(one, b"one-2")
        read_until(two, b"two-4")
        assert len(shells(http, session)) == 2
        two.send(b"sleep 1000 &\r")
        read_until(two, b"]")  # bash's job number: the background sleep runs
    deadline = time.monotonic() + 60
    while shells(http, session):
        assert time.monotonic() < deadline, shells(http, session)
        time.sleep(0.05)
    code = (
        "import os\n"
        "[open(f'/proc/{p}/cmdline','rb').read() for p in os.listdir('/proc') if p.isdigit()]"
    )
    deadline = time.monotonic() + 60
    while True:  # the hung-up shells and what they started are gone (the grace is 2 s)
        left = http.post(f"/v1/sessions/{session}/execute", json={"code": code}).json()
        names = left["result"]["text/plain"]
        if "sleep" not in names and "bash" not in names:
            break
        assert time.monotonic() < deadline, names
        time.sleep(0.1)


def test_the_shell_s_exit_ends_the_socket_with_its_status(server, session):
    with terminal(server, session) as ws:
        ws.send(b"exit 3\r")
        ended = None
        while ended is None:
            frame = ws.recv(timeout=60)
            if isinstance(frame, str):
                ended = json.loads(frame)["exit"]
        assert ended == {"exit_code": 3, "signal": None}
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=60)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000


def test_refusals_close_with_the_status(server, session):
    with terminal(server, "no-such-session") as ws, pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=60)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404
    with terminal(server, session, headers={}) as ws, pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=60)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
    other = {"Authorization": "Bearer t2"}
    with terminal(server, session, headers=other) as ws, pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=60)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404


def test_closing_while_output_flows_still_hangs_the_shell_up(server, http, session):
    with terminal(server, session) as ws:
        ws.send(b"yes flowing\r")
        read_until(ws, b"flowing\r\nflowing")
    # closed mid-flood: the server's send to the socket fails
    deadline = time.monotonic() + 60
    while shells(http, session):
        assert time.monotonic() < deadline, shells(http, session)
        time.sleep(0.05)
