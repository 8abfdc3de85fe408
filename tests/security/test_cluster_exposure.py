"""Attacks on what a server opens to the network: its own ports, and in cluster mode Ray's.

Whoever reaches a Ray cluster's ports can run code on its machines as root (Ray's own security
page says so); a cloche cluster must be reachable from loopback alone, and only with its token.
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from support import ServerProcess, require_cluster, require_gvisor

# A driver from outside cloche: joins the cluster at argv[1] and runs `os.getuid()` on it.
OUTSIDE_DRIVER = """
import os, sys
import ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
    uid = ray.get(ray.remote(num_cpus=0)(lambda: os.getuid()).remote(), timeout=120)
except Exception as exc:
    print("refused:", type(exc).__name__, exc)
else:
    print("ran as uid", uid)
"""


def listeners(root_pid: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of a process tree."""
    root = psutil.Process(root_pid)
    names = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            names[process.pid] = process.name()
        except psutil.NoSuchProcess:
            continue  # it ended meanwhile (Ray starts and reaps workers): it listens nowhere
    return [
        (c.laddr.ip, c.laddr.port, names[c.pid])
        for c in psutil.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.pid in names
    ]


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def outside(gcs: str, env: dict[str, str]) -> str:
    """What a separate process with a clean environment gets from the cluster at gcs (its
    last line of output, then Ray's log)."""
    clean = {
        "PATH": "/usr/bin:/bin",
        "HOME": env.pop("HOME"),
        # Keep this driver on loopback, where the cluster is (Ray would swap in the
        # machine's external address, where nothing of it listens).
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        **env,
    }
    done = subprocess.run(
        [sys.executable, "-c", OUTSIDE_DRIVER, gcs],
        capture_output=True,
        text=True,
        env=clean,
        timeout=180,
        check=False,
    )
    said = done.stdout.strip().splitlines() or ["(nothing)"]
    return f"{said[-1]}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`cloche serve --cluster local:2` with its default settings."""
    require_cluster()
    server = ServerProcess(tmp_path_factory.mktemp("exposure-state"), "--cluster", "local:2")
    yield server
    assert server.stop() == 0, "".join(server.log[-30:])
    assert list(server.state_dir.iterdir()) == []  # the token file too


def cluster_view(server: ServerProcess) -> dict[str, object]:
    view = httpx.get(f"http://127.0.0.1:{server.http_port}/v1/cluster", timeout=60).json()
    assert isinstance(view, dict)
    return view


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_local_cluster_listens_only_on_loopback(cluster: ServerProcess) -> None:
    """Look for a listening socket of `cloche serve --cluster local:2` (Ray's GCS, raylets,
    workers and agents, the node agents' data path) on an address other machines reach.
    Outcome: every one is bound to 127.0.0.1; the dashboard is not started."""
    found = listeners(cluster.process.pid)
    names = {name for _, _, name in found}
    # Every kind of process of the cluster was seen: Ray's GCS and raylets, the node agents.
    assert {"gcs_server", "raylet", "ray::NodeAgent"} <= names, found
    view = cluster_view(cluster)
    gcs_port = int(str(view["ray_address"]).rpartition(":")[2])
    ports = {port for _, port, _ in found}
    assert gcs_port in ports
    nodes = view["nodes"]
    assert isinstance(nodes, list) and len(nodes) == 2
    for node in nodes:  # each agent's data path
        host, _, port = node["address"].rpartition(":")
        assert is_loopback(host) and int(port) in ports, node
    beyond = [entry for entry in found if not is_loopback(entry[0])]
    assert beyond == [], f"listening beyond loopback: {beyond}"


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_cant_run_code_through_ray_from_outside(cluster: ServerProcess, tmp_path: Path) -> None:
    """From another process of the host with a clean environment, join the local cluster's
    Ray (its GCS address) as a driver and run a function there. Outcome: refused, the token
    missing; the same driver given the cluster's token (a 0600 file in the state dir) runs it,
    so the token is what decides; the token is in no log line."""
    gcs = str(cluster_view(cluster)["ray_address"])
    refused = outside(gcs, {"HOME": str(tmp_path)})
    assert refused.startswith("refused:"), refused
    assert "Authentication token is missing or incorrect" in refused, refused
    # The token, and nothing else, is what decides: with it the same driver gets in.
    (token,) = cluster.state_dir.glob("ray-token-*")
    assert token.stat().st_mode & 0o777 == 0o600
    allowed = outside(
        gcs, {"HOME": str(tmp_path), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    )
    assert allowed.startswith("ran as uid 0\n"), allowed
    # And the token is in no log line of the server.
    assert token.read_text() not in "".join(cluster.log)


def test_server_listens_only_on_its_two_ports(tmp_path: Path) -> None:
    """List every listening socket of `cloche serve` with default settings and its children
    (sandboxes included). Outcome: the TCP and HTTP ports on 127.0.0.1, nothing else."""
    require_gvisor()
    server = ServerProcess(tmp_path / "state")
    try:
        with server.client() as client:  # a sandbox runs, and opens nothing
            assert client.run("1 + 1")["output"] == "2\n"
        found = {(address, port) for address, port, _ in listeners(server.process.pid)}
        assert found == {("127.0.0.1", server.tcp_port), ("127.0.0.1", server.http_port)}
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])
