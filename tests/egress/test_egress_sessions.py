"""Sessions in real gVisor sandboxes reach what their policy names, through their door.

The upstreams are servers of this test on 127.0.0.2 (the sandbox's own 127.0.0.1 is its
loopback, and NO_PROXY keeps it there), allowed by address in the server's ceiling: an
HTTP one and an HTTPS one whose certificate comes from a CA of the test's own
(`upstream_ca_file`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from egress_upstream import (
    AUTHORIZATIONS,
    SECRET_VALUE,
    UPSTREAM_HOST,
    Upstream,
    write_secrets,
)
from support import ServerThread, make_config, make_test_ca, require_gvisor


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two upstreams, a policy file naming them, and a gVisor server with it."""
    require_gvisor()
    base = tmp_path_factory.mktemp("egress")
    ca_file, context = make_test_ca(base, UPSTREAM_HOST)
    plain, secure = Upstream(), Upstream(context)
    policy = base / "egress.toml"
    policy.write_text(
        f'upstream_ca_file = "{ca_file}"\n'
        "[policies.test]\n"
        f'allow = ["{UPSTREAM_HOST}:{plain.port}", "{UPSTREAM_HOST}:{secure.port}", '
        f'"example.invalid:443", "localhost:{plain.port}"]\n'
        "[policies.small]\n"
        f'allow = ["{UPSTREAM_HOST}:{plain.port}"]\n'
        "max_connections = 1\n"
        "[policies.secret]\n"
        f'allow = ["{UPSTREAM_HOST}:{plain.port}", "{UPSTREAM_HOST}:{secure.port}"]\n'
        'secrets = ["API_TOKEN"]\n'
    )
    secrets_file = write_secrets(base, secure.port)
    audit = base / "audit.jsonl"
    config = make_config(
        base / "state", egress_policy=policy, egress_audit=audit, egress_secrets=secrets_file
    )
    try:
        with ServerThread(config) as server:
            yield {
                "server": server,
                "plain": plain,
                "secure": secure,
                "audit": audit,
                "data": config.data_dir,
                "config": config,
            }
    finally:
        plain.close()
        secure.close()


@pytest.fixture
def http(world: dict[str, Any]) -> Iterator[httpx.Client]:
    server: ServerThread = world["server"]
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=120) as client:
        yield client


def run(http: httpx.Client, session: str, code: str) -> dict[str, Any]:
    answer = http.post(f"/v1/sessions/{session}/execute", json={"code": code})
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def new_session(http: httpx.Client, egress: Any = None) -> str:
    body = {} if egress is None else {"egress": egress}
    made = http.post("/v1/sessions", json=body)
    assert made.status_code == 201, made.text
    session: str = made.json()["id"]
    return session


FETCH = """
import json, os, ssl, urllib.request, urllib.error
def fetch(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("X-Cloche-Egress"), exc.read().decode()
    except urllib.error.URLError as exc:  # a refused CONNECT: "Tunnel connection failed"
        return "tunnel", str(exc.reason)
"""


def test_a_session_fetches_what_its_policy_names_over_http_and_https(
    world: dict[str, Any], http: httpx.Client
) -> None:
    session = new_session(http, "test")
    assert http.get(f"/v1/sessions/{session}").json()["egress"] == {"policy": "test"}
    plain, secure = world["plain"].port, world["secure"].port
    result = run(
        http,
        session,
        FETCH
        + f"print(fetch('http://{UPSTREAM_HOST}:{plain}/a?b=1'))\n"
        + f"print(fetch('https://{UPSTREAM_HOST}:{secure}/tls'))\n"
        + "print(os.environ['HTTPS_PROXY'], os.environ['NO_PROXY'])",
    )
    assert result["status"] == "ok", result
    lines = result["stdout"].splitlines()
    assert lines[0] == str((200, {"path": "/a?b=1", "host": f"{UPSTREAM_HOST}:{plain}"}))
    assert lines[1] == str((200, {"path": "/tls", "host": f"{UPSTREAM_HOST}:{secure}"}))
    assert lines[2] == "http://127.0.0.1:3128 localhost,127.0.0.1,::1"
    wanted = {("allowed", plain, "GET"), ("allowed", secure, "CONNECT")}

    mine = audit_records(
        world,
        session,
        lambda records: {(r["decision"], r["port"], r["method"]) for r in records} >= wanted,
    )
    assert {(r["decision"], r["port"], r["method"]) for r in mine} >= wanted


def audit_records(
    world: dict[str, Any], session: str, complete: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    """session's audit records, once complete says they are all there (a connection's
    record is written as it ends, which may come just after the cell that made it returned:
    the connection's close crosses the door after the answer)."""

    def mine() -> list[dict[str, Any]]:
        records = [json.loads(line) for line in world["audit"].read_text().splitlines()]
        return [r for r in records if r["session"] == session]

    deadline = time.monotonic() + 60
    while not complete(found := mine()) and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the audit file, with a deadline
    return found


def test_refusals_reach_the_cell_with_the_rule_named(
    world: dict[str, Any], http: httpx.Client
) -> None:
    session = new_session(http, "test")
    plain = world["plain"].port
    result = run(
        http,
        session,
        FETCH
        + "print(fetch('http://169.254.169.254/latest/meta-data/'))\n"
        + f"print(fetch('http://{UPSTREAM_HOST}:{plain + 1}/'))\n"  # a port not named
        + "print(fetch('http://example.com/'))\n",
    )
    assert result["status"] == "ok", result
    for line in result["stdout"].splitlines():
        status, header, body = eval(line)  # noqa: S307  # the tuples printed above
        assert status == 403 and header.startswith("refused;") and "no allow rule" in body
    redirected = run(
        http, session, FETCH + f"print(fetch('http://{UPSTREAM_HOST}:{plain}/redirect'))"
    )
    status, header, body = eval(redirected["stdout"])  # noqa: S307
    assert status == 403 and 'host="example.com"' in header, redirected
    server: ServerThread = world["server"]
    connects = (
        "import socket\n"
        "def connect(target):\n"
        "    with socket.create_connection(('127.0.0.1', 3128), timeout=30) as door:\n"
        "        door.sendall(f'CONNECT {target} HTTP/1.1\\r\\n\\r\\n'.encode())\n"
        "        return door.recv(4096).decode()\n"
        f"for target in ('localhost:{plain}', '127.0.0.1:{server.http_port}', "
        f"'127.0.0.1:{server.tcp_port}', '127.0.0.1:3128', '[::1]:{plain}'):\n"
        "    print(repr(connect(target)))\n"
    )
    answers = run(http, session, connects)["stdout"].splitlines()
    assert len(answers) == 5
    for answer in map(eval, answers):  # noqa: S307
        assert answer.startswith("HTTP/1.1 403 Forbidden"), answer
    assert "a loopback address no allow rule names" in eval(answers[0])  # noqa: S307


def test_a_session_that_asks_for_nothing_has_no_network(
    world: dict[str, Any], http: httpx.Client
) -> None:
    session = new_session(http)  # the ceiling has no `default` policy
    assert http.get(f"/v1/sessions/{session}").json()["egress"] is None
    plain = world["plain"].port
    result = run(
        http,
        session,
        "import os, socket\nprint(os.environ.get('HTTP_PROXY'))\n"
        f"try:\n    socket.create_connection(('{UPSTREAM_HOST}', {plain}), timeout=5)\n"
        "except OSError as exc:\n    print('refused', type(exc).__name__)\n",
    )
    assert result["stdout"].splitlines()[0] == "None"
    assert result["stdout"].splitlines()[1].startswith("refused")


def test_asking_for_more_than_the_ceiling_is_403(http: httpx.Client) -> None:
    wider = http.post(
        "/v1/sessions", json={"egress": {"policy": "small", "allow": ["example.invalid:443"]}}
    )
    assert wider.status_code == 403
    assert "wider than policy 'small'" in wider.json()["error"]["message"]
    unknown = http.post("/v1/sessions", json={"egress": "nope"})
    assert unknown.status_code == 403 and "unknown egress policy" in unknown.text


def test_a_narrowed_policy_and_its_connection_limit(
    world: dict[str, Any], http: httpx.Client
) -> None:
    plain = world["plain"].port
    session = new_session(http, {"policy": "test", "allow": [f"{UPSTREAM_HOST}:{plain}"]})
    assert http.get(f"/v1/sessions/{session}").json()["egress"] == {
        "policy": "test",
        "allow": [f"{UPSTREAM_HOST}:{plain}"],
    }
    secure = world["secure"].port
    result = run(http, session, FETCH + f"print(fetch('https://{UPSTREAM_HOST}:{secure}/')[0])\n")
    assert result["stdout"].strip() == "tunnel", result
    small = new_session(http, "small")
    held = (
        "import socket\nheld = socket.create_connection(('127.0.0.1', 3128))\n"
        f"held.sendall(b'CONNECT {UPSTREAM_HOST}:{plain} HTTP/1.1\\r\\n\\r\\n')\n"
        "print(held.recv(100).split(b'\\r\\n')[0])\n"
    )
    first = run(http, small, held)
    assert first["stdout"].strip() == "b'HTTP/1.1 200 Connection established'", first
    second = run(http, small, FETCH + f"print(fetch('http://{UPSTREAM_HOST}:{plain}/')[:2])")
    assert "429" in second["stdout"] and "max_connections 1" in second["stdout"], second
    # Once the held connection is closed, its place is free again (the host sees the close
    # a moment later: the cell asks until it is, within a deadline).
    third = run(
        http,
        small,
        FETCH
        + "held.close()\nimport time\ndeadline = time.monotonic() + 30\n"
        + f"while (status := fetch('http://{UPSTREAM_HOST}:{plain}/x')[0]) == 429:\n"
        + "    assert time.monotonic() < deadline\nprint(status)\n",
    )
    assert third["stdout"].strip() == "200", third


def test_the_policy_travels_with_pause_snapshot_fork_and_restart(
    world: dict[str, Any], http: httpx.Client
) -> None:
    plain = world["plain"].port
    fetch = FETCH + f"print(fetch('http://{UPSTREAM_HOST}:{plain}/again')[0])\n"
    narrowed = {"policy": "test", "allow": [f"{UPSTREAM_HOST}:{plain}"]}
    session = new_session(http, narrowed)
    assert run(http, session, "kept = 41\n" + fetch)["stdout"].strip() == "200"

    assert http.post(f"/v1/sessions/{session}/pause").status_code == 200
    assert http.get(f"/v1/sessions/{session}").json()["state"] == "paused"
    resumed = run(http, session, "kept += 1\nprint(kept)\n" + fetch)
    assert resumed["stdout"].split() == ["42", "200"], resumed
    assert http.get(f"/v1/sessions/{session}").json()["egress"] == narrowed

    snapshot = http.post(f"/v1/sessions/{session}/snapshot", json={})
    assert snapshot.status_code == 201, snapshot.text
    restored = http.post("/v1/sessions", json={"snapshot": snapshot.json()["id"]})
    assert restored.status_code == 201, restored.text
    assert restored.json()["egress"] == narrowed
    assert run(http, restored.json()["id"], fetch)["stdout"].strip() == "200"

    copies = http.post(f"/v1/sessions/{session}/fork", json={"count": 2})
    assert copies.status_code == 201, copies.text
    for copy in copies.json()["sessions"]:
        assert copy["egress"] == narrowed
        assert run(http, copy["id"], "print(kept)\n" + fetch)["stdout"].split() == ["42", "200"]

    assert http.post(f"/v1/sessions/{session}/restart").status_code == 200
    again = run(http, session, "print('kept' in globals())\n" + fetch)
    assert again["stdout"].split() == ["False", "200"], again
    records = [json.loads(line) for line in world["audit"].read_text().splitlines()]
    ids = {session, restored.json()["id"], *(c["id"] for c in copies.json()["sessions"])}
    assert {r["session"] for r in records if r.get("path") is None} >= ids


def test_a_pause_with_a_tunnel_open_ends_it_and_the_session_goes_on(
    world: dict[str, Any], http: httpx.Client
) -> None:
    plain = world["plain"].port
    session = new_session(http, "test")
    opened = run(
        http,
        session,
        "import socket\nheld = socket.create_connection(('127.0.0.1', 3128))\n"
        f"held.sendall(b'CONNECT {UPSTREAM_HOST}:{plain} HTTP/1.1\\r\\n\\r\\n')\n"
        "print(held.recv(100).split(b'\\r\\n')[0])\n",
    )
    assert opened["stdout"].strip() == "b'HTTP/1.1 200 Connection established'", opened
    paused = http.post(f"/v1/sessions/{session}/pause")
    assert paused.status_code == 200, paused.text
    after = run(
        http,
        session,
        "held.settimeout(30)\ntry:\n    print('ended', held.recv(100))\n"
        "except OSError as exc:\n    print('ended', type(exc).__name__)\n"
        + FETCH
        + f"print(fetch('http://{UPSTREAM_HOST}:{plain}/after')[0])\n",
    )
    assert after["stdout"].split("\n")[0].startswith("ended"), after
    assert after["stdout"].split()[-1] == "200", after


def test_the_sdk_asks_for_egress_and_hears_refusals(world: dict[str, Any]) -> None:
    import cloche

    server: ServerThread = world["server"]
    plain = world["plain"].port
    with cloche.Client(url=f"http://127.0.0.1:{server.http_port}") as client:
        with client.create_session(egress="test") as session:
            assert session.info.egress == {"policy": "test"}
            fetched = session.run(FETCH + f"fetch('http://{UPSTREAM_HOST}:{plain}/sdk')[0]")
            assert fetched.result is not None and fetched.result.text == "200"
        with pytest.raises(cloche.EgressRefused, match="wider than policy 'small'"):
            client.create_session(egress={"policy": "small", "allow": ["example.invalid:443"]})


def test_requests_httpx_and_pip_go_through_the_door(
    world: dict[str, Any], http: httpx.Client
) -> None:
    """The clients people use, unchanged: requests and httpx (from the sandbox's runtime),
    and `pip download` from an index on the upstream (a wheel made here)."""
    plain, secure = world["plain"].port, world["secure"].port
    session = new_session(http, "test")
    result = run(
        http,
        session,
        "import requests, httpx\n"
        f"print(requests.get('http://{UPSTREAM_HOST}:{plain}/requests', timeout=30).json())\n"
        f"print(requests.get('https://{UPSTREAM_HOST}:{secure}/requests', timeout=30).json())\n"
        f"print(httpx.get('http://{UPSTREAM_HOST}:{plain}/httpx', timeout=30).json())\n"
        f"print(httpx.get('https://{UPSTREAM_HOST}:{secure}/httpx', timeout=30).json())\n",
    )
    assert result["status"] == "ok", result
    assert [eval(line)["path"] for line in result["stdout"].splitlines()] == [  # noqa: S307
        "/requests",
        "/requests",
        "/httpx",
        "/httpx",
    ]
    pip = run(
        http,
        session,
        "import subprocess, sys\n"
        "done = subprocess.run([sys.executable, '-m', 'pip', 'download', '--no-deps', "
        f"'--index-url', 'https://{UPSTREAM_HOST}:{secure}/simple/', '-d', '/tmp/got', "
        "'hello-cloche'], capture_output=True, text=True)\n"
        "print(done.returncode, done.stdout[-2000:], done.stderr[-2000:])\n"
        "import os\nprint(sorted(os.listdir('/tmp/got')))\n",
    )
    assert pip["stdout"].splitlines()[-1] == "['hello_cloche-1.0-py3-none-any.whl']", pip


def test_secrets_stay_on_the_host_and_reach_only_their_hosts(
    world: dict[str, Any], http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    plain, secure = world["plain"].port, world["secure"].port
    session = new_session(http, "secret")
    send = (
        "import os, urllib.request\n"
        "def send(url):\n"
        "    request = urllib.request.Request(url, headers={'Authorization': "
        "'Bearer ' + os.environ['API_TOKEN']})\n"
        "    with urllib.request.urlopen(request, timeout=30) as answer:\n"
        "        return answer.status, answer.read().decode()\n"
        f"print(send('https://{UPSTREAM_HOST}:{secure}/with-secret'))\n"
        f"print(send('http://{UPSTREAM_HOST}:{plain}/not-its-host'))\n"
        "print(os.environ['API_TOKEN'])\n"
        "print(open('/proc/self/environ', 'rb').read().count(b'real-token-'))\n"
    )
    result = run(http, session, send)
    assert result["status"] == "ok", result
    lines = result["stdout"].splitlines()
    placeholder = lines[2]
    assert placeholder.startswith("cloche-secret-") and lines[3] == "0"
    seen = dict(AUTHORIZATIONS)
    assert seen["/with-secret"] == f"Bearer {SECRET_VALUE}"  # put in on the host
    assert seen["/not-its-host"] == f"Bearer {placeholder}"  # another host: as it was sent
    mine = audit_records(
        world,
        session,
        lambda records: (
            any(r.get("intercepted") for r in records) and any(r.get("leaked") for r in records)
        ),
    )
    (intercepted,) = [r for r in mine if r.get("intercepted")]
    assert intercepted["secrets"] == ["API_TOKEN"] and intercepted["status"] == 200
    (leak,) = [r for r in mine if r.get("leaked")]
    assert leak["leaked"] == ["API_TOKEN"] and leak["port"] == plain

    # The same placeholder after a pause (it is in the session's memory), and in a copy.
    assert http.post(f"/v1/sessions/{session}/pause").status_code == 200
    again = run(http, session, "print(os.environ['API_TOKEN'])\n" + send)
    assert again["stdout"].splitlines()[0] == placeholder
    copies = http.post(f"/v1/sessions/{session}/fork", json={"count": 1}).json()["sessions"]
    copied = run(http, copies[0]["id"], "print(os.environ['API_TOKEN'])")
    assert copied["stdout"].strip() == placeholder
    assert dict(AUTHORIZATIONS)["/with-secret"] == f"Bearer {SECRET_VALUE}"
    other = new_session(http, "secret")
    assert run(http, other, "import os\nprint(os.environ['API_TOKEN'])")["stdout"].strip() != (
        placeholder
    )

    # The value is in no record, log line, metric or saved image.
    assert SECRET_VALUE not in world["audit"].read_text()
    assert SECRET_VALUE not in http.get("/metrics").text
    assert not any(SECRET_VALUE in r.getMessage() for r in caplog.records)
    assert http.post(f"/v1/sessions/{session}/pause").status_code == 200
    images = [p for p in Path(world["data"]).rglob("*") if p.is_file()]
    assert images and not any(SECRET_VALUE.encode() in p.read_bytes() for p in images)


def test_large_downloads_arrive_whole_over_http_and_https(
    world: dict[str, Any], http: httpx.Client
) -> None:
    """A client inside slower than the upstream (TLS) fills the relay's buffer: reading
    must start again once it drains (a 100 MiB https download once stopped for good)."""
    plain, secure = world["plain"].port, world["secure"].port
    session = new_session(http, "test")
    code = (
        "import urllib.request\n"
        "def size(url):\n"
        "    got = 0\n"
        "    with urllib.request.urlopen(url, timeout=60) as answer:\n"
        "        while piece := answer.read(1 << 16):\n"
        "            got += len(piece)\n"
        "    return got\n"
        f"print(size('https://{UPSTREAM_HOST}:{secure}/mib/40'))\n"
        f"print(size('http://{UPSTREAM_HOST}:{plain}/mib/40'))\n"
    )
    result = run(http, session, code)
    assert result["stdout"].split() == [str(40 << 20)] * 2, result


@pytest.mark.timeout(400)  # two servers of its own, then the module's server's shutdown
def test_a_session_paused_at_shutdown_comes_back_with_its_egress(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """A server of its own (the module's keeps running): stopped with a session in it, then
    started again on the same data directory."""
    plain = world["plain"].port
    config = replace(world["config"], data_dir=tmp_path / "data", egress_audit=None)
    narrowed = {"policy": "secret", "allow": [f"{UPSTREAM_HOST}:{plain}"]}
    with ServerThread(config) as first:
        with httpx.Client(base_url=f"http://127.0.0.1:{first.http_port}", timeout=120) as api:
            session = new_session(api, narrowed)
            placeholder = run(api, session, "import os\nkept = os.environ['API_TOKEN']")
            assert placeholder["status"] == "ok", placeholder
    with ServerThread(config) as second:
        with httpx.Client(base_url=f"http://127.0.0.1:{second.http_port}", timeout=120) as api:
            assert api.get(f"/v1/sessions/{session}").json()["egress"] == narrowed
            again = run(
                api,
                session,
                "print(kept == os.environ['API_TOKEN'])\n"
                + FETCH
                + f"print(fetch('http://{UPSTREAM_HOST}:{plain}/back')[0])\n",
            )
            assert again["stdout"].split() == ["True", "200"], again
