"""Attacks through ports: from inside a session, at the server and the host through its ports
door; from outside, at another session (or the host) through a port route.

Two tenants: Alice's session A and Bob's session B each run the echo app on port 8000, which
names itself in its answers and keeps a log of the requests it saw. Every attack below is
Alice's (or nobody's); none may reach B's app (its log stays empty of them) or anything of
the host, and A still answers afterwards.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from port_apps import ECHO, start_app
from support import ServerThread, make_config, require_gvisor

pytestmark = [pytest.mark.gvisor, pytest.mark.timeout(600)]
ALICE, BOB = "alice-token", "bob-token"
DOMAIN = "preview.test"
# An app that answers once, then a second time unasked: a forged answer of B's.
LIAR = r"""
import socket, sys
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen(16)
while True:
    conn, _ = listener.accept()
    request = b""
    while b"\r\n\r\n" not in request:
        request += conn.recv(65536) or b"\r\n\r\n"
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-App-Name: liar\r\n\r\nfirst"
        b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nX-App-Name: B\r\n\r\npoison"
    )
"""


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_gvisor()
    state = tmp_path_factory.mktemp("port-attacks-state")
    config = make_config(state, tokens=frozenset({ALICE, BOB}), preview_domain=DOMAIN)
    with ServerThread(config) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        alice = httpx.Client(base_url=base, timeout=120, headers=_bearer(ALICE))
        bob = httpx.Client(base_url=base, timeout=120, headers=_bearer(BOB))
        try:
            a = alice.post("/v1/sessions").json()["id"]
            b = bob.post("/v1/sessions").json()["id"]
            start_app(alice, a, ECHO, 8000, "127.0.0.1", "A")
            start_app(alice, a, LIAR, 8001, name="liar.py")
            start_app(bob, b, ECHO, 8000, "127.0.0.1", "B")
            yield {"server": server, "alice": alice, "bob": bob, "a": a, "b": b}
        finally:
            alice.close()
            bob.close()


@pytest.fixture
def b_untouched(sessions) -> Iterator[None]:
    """B's app sees no request of the attack, and A still answers after it."""
    bob, b = sessions["bob"], sessions["b"]
    before = bob.get(f"/v1/sessions/{b}/ports/8000/log").json()
    yield
    assert bob.get(f"/v1/sessions/{b}/ports/8000/log").json() == before
    after = sessions["alice"].get(f"/v1/sessions/{sessions['a']}/ports/8000/x")
    assert after.status_code == 200 and after.headers["x-app-name"] == "A"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


Answer = tuple[int, dict[str, str], bytes]


def _raw(
    server: ServerThread, data: bytes, answers: int
) -> list[tuple[int, dict[str, str], bytes]]:
    """Send bytes as they are on one connection; the answers read from it (status, headers
    in lower case, body), as many as come before it closes, goes quiet or answers are
    read. The first answer may take long (a sandbox's app); one more, to requests sent
    together, would follow at once: 10 s of quiet after one ends the reading."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=60) as sock:
        sock.sendall(data)
        reader = sock.makefile("rb")
        found = []
        for _ in range(answers):
            if found:
                sock.settimeout(10)
            try:
                status_line = reader.readline()
            except TimeoutError:
                break
            if not status_line:
                break
            headers: dict[str, str] = {}
            while (line := reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if headers.get("transfer-encoding") == "chunked":
                body = b""
                while size := int(reader.readline().split(b";")[0], 16):
                    body += reader.read(size)
                    reader.readline()
                reader.readline()
            else:
                body = reader.read(int(headers.get("content-length", "0")))
            found.append((int(status_line.split()[1]), headers, body))
        return found


def _names(answers: list[Answer]) -> list[str]:
    """Who answered each: an app's name, or cloche's status."""
    return [h.get("x-app-name") or str(status) for status, h, _ in answers]


def test_cant_reach_the_servers_ports_from_inside_with_ports_in_use(sessions, b_untouched):
    """With A's ports door open (a request went through it), a cell in A connects to the
    server's ports, looks for host sockets, and speaks to the ports door itself, as the
    relay would, asking it for the server's HTTP port. Outcome: refused everywhere; the
    door only ever gives what the host asks of it, and the host asks nothing of a cell."""
    alice, a, server = sessions["alice"], sessions["a"], sessions["server"]
    assert alice.get(f"/v1/sessions/{a}/ports/8000/x").status_code == 200
    http, tcp = server.http_port, server.tcp_port
    code = f"""
import os, socket, stat
def attempt(host, port):
    try:
        socket.create_connection((host, port), timeout=2).close()
        return 'connected'
    except OSError as exc:
        return type(exc).__name__
found = []
for top in ('/run', '/var/run', '/tmp', '/home'):
    for root, dirs, files in os.walk(top):
        for name in files:
            if stat.S_ISSOCK(os.lstat(os.path.join(root, name)).st_mode):
                found.append(os.path.join(root, name))
door = socket.socket(socket.AF_UNIX)
door.connect('/run/cloche/ports.sock')
door.settimeout(3)
door.sendall(b'C {http}\\nGET /v1/sessions HTTP/1.1\\r\\nHost: x\\r\\n\\r\\nL\\n')
try:
    heard = door.recv(65536)
except socket.timeout:
    heard = b'(nothing)'
door.close()
print(sorted(found))
print([attempt(h, p) for h in ('127.0.0.1', 'localhost', '::1') for p in ({http}, {tcp})])
print(heard)
"""
    ran = alice.post(f"/v1/sessions/{a}/execute", json={"code": code})
    assert ran.status_code == 200, ran.text
    assert ran.json()["status"] == "ok", ran.json()
    lines = ran.json()["stdout"].splitlines()
    # the ports' door, and the supervisor's (which only its token opens: test_egress_attacks)
    assert lines[0] == "['/run/cloche/ports.sock', '/run/cloche/procd.sock']"
    assert "connected" not in lines[1]
    assert "HTTP" not in lines[2] and "sessions" not in lines[2]
    assert lines[2] in ("b'(nothing)'", "b''")


def test_a_host_trick_reaches_no_other_session(sessions, b_untouched):
    """Alice names B's preview host in Host (or in odd spellings of it) on requests to A's
    path route, with her token or A's preview token. Outcome: B's host routes to B, which
    is not hers: 404; the odd spellings name no port; none reaches B's app."""
    alice, a, b = sessions["alice"], sessions["a"], sessions["b"]
    token = alice.post(f"/v1/sessions/{a}/ports/8000/url", json={}).json()["url"]
    token = token.rsplit("cloche_preview=", 1)[1]
    path = f"/v1/sessions/{a}/ports/8000/x"
    b_host = f"8000-{b}.{DOMAIN}"
    with httpx.Client(base_url=str(alice.base_url), timeout=120) as nobody:
        for answer in (
            alice.get(path, headers={"Host": b_host}),
            alice.get(path, headers={"Host": b_host.upper() + "."}),
            alice.get(path, headers={"Host": f"{b_host}:80", "X-Forwarded-Host": "a"}),
            nobody.get(f"{path}?cloche_preview={token}", headers={"Host": b_host}),
        ):
            assert answer.status_code == 404, answer.text
            assert "x-app-name" not in answer.headers
        for odd in (f"8000-{a}.{DOMAIN}@{b_host}", f"{b_host}.evil.example", f"x{b_host}"):
            answer = alice.get(path, headers={"Host": odd})
            assert answer.headers.get("x-app-name") in (None, "A"), (odd, answer.text)


def test_dot_dot_in_the_path_reaches_no_other_session(sessions, b_untouched):
    """Paths with `..` (plain and percent-encoded, sent as they are) that would lead from A's
    port route to B's. Outcome: the route is decided by the path's first segments; what
    follows goes to A's app as it is, and a path that is not a port route is the API's."""
    server, a, b = sessions["server"], sessions["a"], sessions["b"]
    paths = [
        f"/v1/sessions/{a}/ports/8000/../../../{b}/ports/8000/x",
        f"/v1/sessions/{a}/ports/8000/..%2f..%2f..%2f{b}%2fports%2f8000%2fx",
        f"/v1/sessions/{a}/ports/8000/%2e%2e/%2e%2e/%2e%2e/{b}/ports/8000/x",
        f"/v1/sessions/{a}/../{b}/ports/8000/x",
        f"/v1/sessions/{a}/ports/..%2f..%2f{b}%2fports%2f8000/x",
        f"/v1/sessions/{b}/ports/8000/../../../{a}/ports/8000/x",
    ]
    requests = b"".join(
        f"GET {p} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ALICE}\r\n\r\n".encode()
        for p in paths
    )
    answers = _raw(server, requests, len(paths))
    assert _names(answers) == ["A", "A", "A", "404", "404", "404"]
    seen = json.loads(answers[0][2])["path"]
    assert seen == f"/../../../{b}/ports/8000/x"  # A's app got it as it came


def test_an_absolute_url_in_the_request_line_reaches_no_other_session(sessions, b_untouched):
    """Request lines in absolute form naming B's preview host, B's path route, or another
    service of the host. Outcome: the Host header and the path decide, as for any request;
    A's app gets an origin-form target; nothing connects anywhere but inside A."""
    server, a, b = sessions["server"], sessions["a"], sessions["b"]
    a_host, b_host = f"8000-{a}.{DOMAIN}", f"8000-{b}.{DOMAIN}"
    lines = [
        (f"http://{b_host}/x", a_host),
        (f"http://127.0.0.1:{server.http_port}/v1/sessions/{b}/ports/8000/x", "127.0.0.1"),
        (f"http://{a_host}/x", b_host),
        ("http://127.0.0.1:22/", "127.0.0.1"),
    ]
    requests = b"".join(
        f"GET {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {ALICE}\r\n\r\n".encode()
        for target, host in lines
    )
    answers = _raw(server, requests, len(lines))
    names = _names(answers)
    assert names[:3] == ["A", "404", "404"]
    assert json.loads(answers[0][2])["path"] == "/x"
    assert names[3] in ("404", "405", "422")  # the API's own root: never a connection to :22


def test_request_smuggling_between_sessions(sessions, b_untouched):
    """Requests to A whose framing disagrees with itself (CL.TE, TE.CL, an obfuscated
    Transfer-Encoding), and well-framed ones, each carrying a request to B's port route
    with Bob's token inside its body. Outcome: the front end refuses a request it can't
    frame (400); what A's app gets is written afresh, one request, the hidden one its body
    and never a request, to B or to A."""
    server, a, b = sessions["server"], sessions["a"], sessions["b"]
    hidden = (
        f"GET /v1/sessions/{b}/ports/8000/smuggled HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {BOB}\r\n\r\n"
    )
    echo = f"/v1/sessions/{a}/ports/8000/echo"
    head = f"POST {echo} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ALICE}\r\n"
    chunk = f"{len(hidden):x}\r\n{hidden}\r\n0\r\n\r\n"
    attempts = [
        # CL.TE: a length that covers an empty chunked body and the hidden request
        head + f"Content-Length: {5 + len(hidden)}\r\nTransfer-Encoding: chunked\r\n\r\n"
        f"0\r\n\r\n{hidden}",
        # TE.CL: a chunk holding the hidden request, and a length that ends before it
        head + f"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n{chunk}",
        # an obfuscated Transfer-Encoding beside a length
        head + f"Transfer-Encoding: xchunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n{hidden}",
        head + f"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n{chunk}",
        # well framed, the hidden request only a body: A's echo answers it back as data
        head + f"Transfer-Encoding: chunked\r\n\r\n{chunk}",
        head + f"Content-Length: {len(hidden)}\r\n\r\n{hidden}",
    ]
    reached_a = 0
    a_log = f"/v1/sessions/{a}/ports/8000/log"
    for attempt in attempts:
        before = len(sessions["alice"].get(a_log).json())
        answers = _raw(server, attempt.encode() + b"", 3)
        names = _names(answers)
        assert "B" not in names, (attempt, answers)
        for name, (_, _, body) in zip(names, answers, strict=True):
            assert b"smuggled" not in body or name == "A"  # A's echo of its own body
        seen = sessions["alice"].get(a_log).json()[before:]
        assert all("smuggled" not in entry for entry in seen), seen  # a body, never a request
        reached_a += names.count("A")
    assert reached_a == 2  # the framings the front end could not read were 400s


def test_pipelined_requests_to_two_sessions_on_one_connection(sessions, b_untouched):
    """One connection carries, back to back, a request to A, one to B with Alice's token,
    and one to A's host route. Outcome: each is routed and checked on its own: A, 404, A."""
    server, a, b = sessions["server"], sessions["a"], sessions["b"]
    auth = f"Authorization: Bearer {ALICE}\r\n"
    requests = (
        f"GET /v1/sessions/{a}/ports/8000/x HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n"
        f"GET /v1/sessions/{b}/ports/8000/x HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n"
        f"GET /x HTTP/1.1\r\nHost: 8000-{a}.{DOMAIN}\r\n{auth}\r\n"
    ).encode()
    assert _names(_raw(server, requests, 3)) == ["A", "404", "A"]


def test_an_app_that_answers_twice_poisons_no_later_request(sessions, b_untouched):
    """A's second app sends an extra, unasked answer that claims to be B's, after its own.
    The client's next request on the same connection goes to A's echo. Outcome: the extra
    answer is dropped with its connection to the app; the client gets the echo's."""
    server, a = sessions["server"], sessions["a"]
    auth = f"Authorization: Bearer {ALICE}\r\n"
    requests = (
        f"GET /v1/sessions/{a}/ports/8001/ HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n"
        f"GET /v1/sessions/{a}/ports/8001/ HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n"
        f"GET /v1/sessions/{a}/ports/8000/x HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n"
    ).encode()
    answers = _raw(server, requests, 3)
    assert _names(answers) == ["liar", "liar", "A"], answers
    assert [body for _, _, body in answers[:2]] == [b"first", b"first"]


def test_a_port_of_another_tenants_session_is_404_however_asked(sessions, b_untouched):
    """Alice's token on B's port routes: path, host, websocket, listing, a preview URL.
    Outcome: 404 each way, as for a session that does not exist; the websocket upgrade is
    refused before any connection to B's app."""
    alice, b, server = sessions["alice"], sessions["b"], sessions["server"]
    assert alice.get(f"/v1/sessions/{b}/ports/8000/x").status_code == 404
    assert alice.get("/x", headers={"Host": f"8000-{b}.{DOMAIN}"}).status_code == 404
    assert alice.get(f"/v1/sessions/{b}/ports").status_code == 404
    assert alice.post(f"/v1/sessions/{b}/ports/8000/url", json={}).status_code == 404
    upgrade = (
        f"GET /v1/sessions/{b}/ports/8000/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {ALICE}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()
    started = time.monotonic()
    answers = _raw(server, upgrade, 1)
    assert answers and answers[0][0] == 404, answers
    assert time.monotonic() - started < 60
