"""Who may reach a port: the owner's token, or a preview URL for exactly that session and port
until it expires; everyone else gets cloche's refusal (401, 404), never the app's answer."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from port_apps import ECHO, start_app
from support import ServerThread, make_config, require_gvisor

pytestmark = [pytest.mark.gvisor, pytest.mark.timeout(600)]
ALICE, BOB = "alice-token", "bob-token"
DOMAIN = "preview.test"


@pytest.fixture(scope="module")
def served(state_root) -> Iterator[dict[str, Any]]:
    """Alice's sessions A (the echo app "A" on 8000 and "A-8080" on 8080) and A2 ("A2" on
    8000), Bob's session B ("B" on 8000)."""
    require_gvisor()
    config = make_config(
        state_root, tokens=frozenset({ALICE, BOB}), preview_domain=DOMAIN, pool_size=3
    )
    with ServerThread(config) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        clients = {
            "alice": httpx.Client(base_url=base, timeout=120, headers=_bearer(ALICE)),
            "bob": httpx.Client(base_url=base, timeout=120, headers=_bearer(BOB)),
            "anyone": httpx.Client(base_url=base, timeout=120),
        }
        alice, bob = clients["alice"], clients["bob"]
        try:
            a = alice.post("/v1/sessions").json()["id"]
            a2 = alice.post("/v1/sessions").json()["id"]
            b = bob.post("/v1/sessions").json()["id"]
            start_app(alice, a, ECHO, 8000, "127.0.0.1", "A")
            start_app(alice, a, ECHO, 8080, "0.0.0.0", "A-8080", name="app2.py")
            start_app(alice, a2, ECHO, 8000, "127.0.0.1", "A2")
            start_app(bob, b, ECHO, 8000, "127.0.0.1", "B")
            yield {"server": server, **clients, "a": a, "a2": a2, "b": b}
        finally:
            for client in clients.values():
                client.close()


@pytest.fixture(autouse=True)
def no_cookies_kept(served) -> None:
    """Each test starts with clients that hold no cookie of an earlier one's."""
    for name in ("alice", "bob", "anyone"):
        served[name].cookies.clear()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _preview_url(client: httpx.Client, session_id: str, port: int, ttl_s: int = 600) -> str:
    made = client.post(f"/v1/sessions/{session_id}/ports/{port}/url", json={"ttl_s": ttl_s})
    assert made.status_code == 200, made.text
    assert made.json()["expires_at"].endswith("+00:00")
    url: str = made.json()["url"]
    return url


def _token(url: str) -> str:
    return url.rsplit("cloche_preview=", 1)[1]


def _via(client: httpx.Client, url: str, **kwargs: Any) -> httpx.Response:
    """A request to a preview URL of the preview domain, sent to the server (no DNS here)."""
    parts = urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    headers = {"Host": parts.netloc, **kwargs.pop("headers", {})}
    return client.get(path, headers=headers, **kwargs)


def _refused(response: httpx.Response, status: int) -> None:
    """cloche's refusal, never the app's answer."""
    assert response.status_code == status, response.text
    assert "x-app-name" not in response.headers
    assert response.json()["error"]["type"] in ("unauthorized", "not_found")


def test_a_preview_url_works_without_the_api_token_until_it_expires(served):
    alice, a = served["alice"], served["a"]
    url = _preview_url(alice, a, 8000, ttl_s=4)
    assert urlsplit(url).netloc == f"8000-{a}.{DOMAIN}"
    with httpx.Client(base_url=str(alice.base_url), timeout=120) as browser:  # no token
        first = _via(browser, url)
        assert first.status_code == 200, first.text
        assert first.headers["x-app-name"] == "A"
        cookie = first.headers["set-cookie"]
        assert cookie.startswith(f"cloche_preview={_token(url)}; ")
        assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Path=/;" in cookie
        # The cookie alone (the app's own links): the browser sends it back.
        again = browser.get("/x", headers={"Host": f"8000-{a}.{DOMAIN}"})
        assert again.status_code == 200
        assert again.headers["x-app-name"] == "A"
        deadline = time.monotonic() + 120
        while True:  # polled: the token expires on the server's clock, 4 s after it was made
            answer = _via(browser, url)
            if answer.status_code != 200:
                break
            assert answer.headers["x-app-name"] == "A"
            assert time.monotonic() < deadline, "the preview URL never stopped working"
            time.sleep(0.25)
        _refused(answer, 401)
        assert "expired" in answer.json()["error"]["message"]
        _refused(browser.get("/x", headers={"Host": f"8000-{a}.{DOMAIN}"}), 401)


def test_a_preview_url_without_a_preview_domain_is_the_path_route(served):
    alice, a = served["alice"], served["a"]
    hosts = served["server"].server.http.app.state.hosts
    domain, hosts.domain = hosts.domain, None
    try:
        url = _preview_url(alice, a, 8000)
    finally:
        hosts.domain = domain
    parts = urlsplit(url)
    assert parts.path == f"/v1/sessions/{a}/ports/8000/"
    opened = served["anyone"].get(f"{parts.path}?{parts.query}")
    assert opened.status_code == 200
    assert opened.headers["x-app-name"] == "A"
    assert f"Path=/v1/sessions/{a}/ports/8000/" in opened.headers["set-cookie"]


def test_a_preview_token_opens_its_session_and_port_only(served):
    alice, anyone = served["alice"], served["anyone"]
    a, a2, b = served["a"], served["a2"], served["b"]
    token = _token(_preview_url(alice, a, 8000))
    for session_id, port in ((a, 8080), (a2, 8000), (b, 8000)):
        path = f"/v1/sessions/{session_id}/ports/{port}/"
        _refused(anyone.get(f"{path}?cloche_preview={token}"), 404)
        _refused(anyone.get(path, headers={"Cookie": f"cloche_preview={token}"}), 404)
        host = {"Host": f"{port}-{session_id}.{DOMAIN}"}
        _refused(anyone.get(f"/?cloche_preview={token}", headers=host), 404)
    # Nor is it a bearer token, of the API or of a port.
    as_bearer = httpx.Client(base_url=str(alice.base_url), timeout=120, headers=_bearer(token))
    with as_bearer:
        assert as_bearer.get(f"/v1/sessions/{a}").status_code == 401
        assert as_bearer.get("/v1/sessions").status_code == 401
        _refused(as_bearer.get(f"/v1/sessions/{a}/ports/8000/"), 401)


def test_another_tenant_gets_404_and_no_credentials_401(served):
    bob, anyone, a = served["bob"], served["anyone"], served["a"]
    path = f"/v1/sessions/{a}/ports/8000/x"
    host = {"Host": f"8000-{a}.{DOMAIN}"}
    _refused(bob.get(path), 404)
    _refused(bob.get("/x", headers=host), 404)
    _refused(bob.post(path, content=b"data"), 404)
    assert bob.get(f"/v1/sessions/{a}/ports").status_code == 404
    assert bob.post(f"/v1/sessions/{a}/ports/8000/url", json={}).status_code == 404
    _refused(anyone.get(path), 401)
    _refused(anyone.get("/x", headers=host), 401)
    _refused(anyone.get(path, headers=_bearer("not-a-token")), 401)
    _refused(anyone.get(f"{path}?cloche_preview=forged.token"), 401)
    _refused(anyone.get(path, headers={"Cookie": "cloche_preview=forged.token"}), 401)
    assert anyone.get(f"/v1/sessions/{a}/ports").status_code == 401
    server: ServerThread = served["server"]
    for headers, status in ((_bearer(BOB), 404), ({}, 401)):
        with pytest.raises(InvalidStatus) as refused:
            ws_connect(
                f"ws://127.0.0.1:{server.http_port}{path}", additional_headers=headers
            ).close()
        assert refused.value.response.status_code == status
        assert b"X-App-Name" not in bytes(refused.value.response.body or b"")


def test_a_preview_token_from_another_session_on_a_parent_domain_cookie_is_not_enough(served):
    """A page of another port may set a cookie for the whole preview domain: each
    cloche_preview cookie is tried, and the good one still opens its own port."""
    alice, anyone, a = served["alice"], served["anyone"], served["a"]
    own = _token(_preview_url(alice, a, 8000))
    other = _token(_preview_url(alice, served["a2"], 8000))
    both = {"Host": f"8000-{a}.{DOMAIN}", "Cookie": f"cloche_preview={other}; cloche_preview={own}"}
    opened = anyone.get("/x", headers=both)
    assert opened.status_code == 200
    assert opened.headers["x-app-name"] == "A"
    assert own not in opened.text and other not in opened.text  # the app saw neither
    _refused(anyone.get("/x", headers={**both, "Cookie": f"cloche_preview={other}"}), 404)


def test_bad_preview_asks_are_400s(served):
    alice, a = served["alice"], served["a"]
    for body in ({"ttl_s": 0}, {"ttl_s": 86401}, {"ttl_s": "soon"}, {"other": 1}):
        asked = alice.post(f"/v1/sessions/{a}/ports/8000/url", json=body)
        assert asked.status_code == 400, (body, asked.text)
    for port in ("0", "65536", "http"):
        asked = alice.post(f"/v1/sessions/{a}/ports/{port}/url", json={})
        assert asked.status_code in (400, 404), (port, asked.text)
    assert alice.post(f"/v1/sessions/{a}/ports/8000/url").status_code == 200  # no body


def test_a_host_of_the_preview_domain_that_names_no_port_is_never_the_api(served):
    alice, a = served["alice"], served["a"]
    for host in (f"www.{DOMAIN}", f"8000-{a}x.{DOMAIN}", f"99999-{a}.{DOMAIN}", f"0-{a}.{DOMAIN}"):
        answer = alice.get("/v1/sessions", headers={"Host": host})
        assert answer.status_code == 404, (host, answer.text)
        assert "sessions" not in answer.json()


def test_two_hosts_are_refused(served):
    server: ServerThread = served["server"]
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=60) as sock:
        sock.sendall(
            f"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 8000-{served['a']}.{DOMAIN}\r\n"
            f"Authorization: Bearer {ALICE}\r\nConnection: close\r\n\r\n".encode()
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b"X-App-Name" not in answer
