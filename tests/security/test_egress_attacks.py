"""Attacks through a session's egress door: the proxy on the host, its unix socket, secrets.

A server of this module's own runs with --egress-policy and --secrets; the attacker's session
has a policy that allows one upstream of the test (on 127.0.0.2, named by address) and holds
a secret's placeholder for it.
"""

from __future__ import annotations

import http.server as http_server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloche.config import Limits
from support import ServerThread, make_config, require_gvisor

SECRET = "attack-canary-value-7d1e"  # noqa: S105  # the value only the host may see


class _Upstream(http_server.BaseHTTPRequestHandler):
    seen: list[str] = []  # noqa: RUF012  # Authorization headers, as received

    def do_GET(self) -> None:  # noqa: N802
        self.seen.append(self.headers.get("Authorization") or "")
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_gvisor()
    base = tmp_path_factory.mktemp("egress-attacks")
    upstream = http_server.ThreadingHTTPServer(("127.0.0.2", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = upstream.server_address[1]
    policy = base / "egress.toml"
    policy.write_text(  # the secret's host (127.0.0.3) is allowed; nothing listens there
        f'[policies.default]\nallow = ["127.0.0.2:{port}", "127.0.0.3:{port}"]\n'
        'secrets = ["CANARY_TOKEN"]\n'
    )
    secrets = base / "secrets.toml"
    secrets.write_text(
        f'[secrets.CANARY_TOKEN]\nvalue = "{SECRET}"\nhosts = ["127.0.0.3:{port}"]\n'
    )
    secrets.chmod(0o600)
    # The socket search walks the runtime's site-packages (~15,000 files) through gVisor's
    # file server: tens of seconds on a busy machine.
    limits = Limits(cell_timeout_s=180.0, interrupt_grace_s=2.0)
    config = make_config(
        base / "state",
        pool_size=2,
        egress_policy=policy,
        egress_secrets=secrets,
        limits=limits,
    )
    try:
        with ServerThread(config) as server:
            yield {"server": server, "port": port, "data": config.data_dir}
    finally:
        upstream.shutdown()
        upstream.server_close()


def _cell(door: dict[str, Any], code: str, session: str | None = None) -> tuple[str, str]:
    server: ServerThread = door["server"]
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=300) as api:
        if session is None:
            made = api.post("/v1/sessions", json={})
            assert made.status_code == 201, made.text
            session = made.json()["id"]
        result = api.post(f"/v1/sessions/{session}/execute", json={"code": code}).json()
    assert result["status"] == "ok", result
    return session, str(result["stdout"])


CONNECT = (
    "import socket\n"
    "def connect(target):\n"
    "    with socket.create_connection(('127.0.0.1', 3128), timeout=30) as proxy:\n"
    "        proxy.sendall(f'CONNECT {target} HTTP/1.1\\r\\n\\r\\n'.encode())\n"
    "        return proxy.recv(4096).decode().split('\\r\\n')[0]\n"
)


def test_egress_cant_reach_metadata_loopback_or_the_server(door):
    """Through the egress proxy, CONNECT to the cloud metadata address, the host's loopback,
    the server's own ports and a private address. Outcome: each is a 403 naming the rule; the
    proxy connects to none."""
    server: ServerThread = door["server"]
    targets = [
        "169.254.169.254:80",
        f"127.0.0.1:{door['port']}",
        f"localhost:{server.http_port}",
        f"127.0.0.1:{server.tcp_port}",
        "10.0.0.1:22",
        f"[::1]:{server.http_port}",
    ]
    _, output = _cell(door, CONNECT + f"for t in {targets!r}:\n    print(connect(t))\n")
    assert output.splitlines() == ["HTTP/1.1 403 Forbidden"] * len(targets)


def test_the_doors_are_the_only_host_sockets_and_the_supervisors_wants_its_token(door):
    """Use the sandbox's permission to open host unix sockets: look for any socket under /run,
    /var/run, /tmp, the home and /opt, connect to the Docker and containerd socket paths,
    and to the process supervisor's door as the supervisor with a guessed token. Outcome:
    the session's own doors (egress, supervisor) are the only sockets there are; the
    supervisor's closes at once, answering nothing, and the session's commands go on."""
    server: ServerThread = door["server"]
    session, output = _cell(
        door,
        "import os, socket, stat, json, struct\nfound = []\n"
        "for top in ('/run', '/var/run', '/tmp', '/home', '/opt'):\n"
        "    for root, dirs, files in os.walk(top):\n"
        "        for name in files:\n"
        "            path = os.path.join(root, name)\n"
        "            if stat.S_ISSOCK(os.lstat(path).st_mode):\n"
        "                found.append(path)\n"
        "print(sorted(found))\n"
        "for path in ('/var/run/docker.sock', '/run/containerd/containerd.sock'):\n"
        "    try:\n"
        "        socket.socket(socket.AF_UNIX).connect(path)\n"
        "        print('connected', path)\n"
        "    except OSError as exc:\n"
        "        print('refused', type(exc).__name__)\n"
        "impostor = socket.socket(socket.AF_UNIX)\n"
        "impostor.settimeout(60)\n"
        "impostor.connect('/run/cloche/procd.sock')\n"
        "hello = json.dumps({'op': 'proc.hello', 'token': 'guessed'}).encode()\n"
        "impostor.sendall(struct.pack('>I', len(hello)) + hello)\n"
        "print('supervisor door said', impostor.recv(4096))\n",
    )
    lines = output.splitlines()
    assert lines[0] == "['/run/cloche/door.sock', '/run/cloche/procd.sock']"
    assert all(line.startswith("refused") for line in lines[1:3])
    assert lines[3] == "supervisor door said b''"
    ran = httpx.post(
        f"http://127.0.0.1:{server.http_port}/v1/sessions/{session}/commands",
        json={"cmd": "echo still-mine"},
        timeout=120,
    )
    assert ran.status_code == 200 and ran.json()["stdout"] == "still-mine\n", ran.text


def test_egress_secret_value_never_reaches_the_sandbox(door):
    """Look for a secret's value in the environment and /proc, and send its placeholder to a
    host the secret is not for. Outcome: only the placeholder is inside; it arrives
    unreplaced, and the value is in no record or saved image."""
    port = door["port"]
    session, output = _cell(
        door,
        "import os, urllib.request\n"
        "token = os.environ['CANARY_TOKEN']\n"
        "print(token.startswith('cloche-secret-'))\n"
        "print(open('/proc/self/environ', 'rb').read().count(b'attack-canary'))\n"
        "request = urllib.request.Request("
        f"'http://127.0.0.2:{port}/', headers={{'Authorization': token}})\n"
        "print(urllib.request.urlopen(request, timeout=30).read())\n",
    )
    assert output.splitlines() == ["True", "0", "b'ok'"]
    assert _Upstream.seen[-1].startswith("cloche-secret-")
    server: ServerThread = door["server"]
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=300) as api:
        assert api.post(f"/v1/sessions/{session}/pause").status_code == 200
    saved = [p for p in Path(door["data"]).rglob("*") if p.is_file()]
    assert saved and not any(SECRET.encode() in p.read_bytes() for p in saved)
    audit = Path(door["data"]) / "egress" / "audit.jsonl"
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert any(r.get("leaked") == ["CANARY_TOKEN"] for r in records)
