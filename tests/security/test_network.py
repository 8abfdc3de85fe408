"""Attacks that try to reach a network: the internet, the server, the host's loopback."""

from __future__ import annotations

import socket

import pytest

CONNECT = (
    "import socket\n"
    "def attempt(host, port):\n"
    "    try:\n"
    "        socket.create_connection((host, port), timeout=2).close()\n"
    "        return 'connected'\n"
    "    except OSError as exc:\n"
    "        return type(exc).__name__\n"
)


@pytest.fixture
def host_listener():
    """A TCP listener on the host's loopback, as any local service would be."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener.getsockname()[1]


def test_cant_reach_the_internet(attacker, witness):
    """Connect to a public address, and resolve a name. Outcome: no route, no resolver."""
    with witness.watching():
        output = attacker.value(
            CONNECT + "import socket\n"
            "def resolve(name):\n"
            "    try: return socket.gethostbyname(name)\n"
            "    except OSError as exc: return type(exc).__name__\n"
            "attempt('8.8.8.8', 53), attempt('1.1.1.1', 443), resolve('example.com')"
        )
    assert "connected" not in output
    assert "." not in output.split(",")[-1]  # no address came back


def test_cant_reach_the_servers_own_ports(attacker, witness, secure_server):
    """Connect to the server's TCP and HTTP ports on 127.0.0.1. Outcome: refused."""
    tcp, http = secure_server.tcp_port, secure_server.http_port
    with witness.watching():
        output = attacker.value(
            CONNECT + f"attempt('127.0.0.1', {tcp}), attempt('localhost', {http})"
        )
    assert "connected" not in output


def test_cant_reach_any_host_loopback_address(attacker, witness, host_listener):
    """Connect to a service listening on the host's loopback, via 127.0.0.1 and other 127.x
    addresses. Outcome: the sandbox's loopback is its own; nothing is there."""
    with witness.watching():
        output = attacker.value(
            CONNECT
            + f"[attempt(h, {host_listener}) for h in ('127.0.0.1', '127.0.1.1', '127.9.9.9')]"
        )
    assert "connected" not in output


def test_network_interfaces_are_loopback_only(attacker, witness):
    """List network interfaces. Outcome: only lo."""
    with witness.watching():
        output = attacker.value("import socket; [name for _, name in socket.if_nameindex()]")
    assert output == "['lo']\n"
