"""Where a session's connection may go: the policy's word, then the address it would reach.

The host resolves names (the sandbox has no resolver) and connects to the address it
checked, so a name cannot change its answer between the check and the connection. Loopback,
link-local (169.254.0.0/16: the cloud metadata address), private, shared, reserved and
multicast addresses are refused unless an allow rule names the address (or its network)
explicitly; so is any address of this machine (a connection whose two ends have one
address), which covers the server's own ports and the cluster's.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

from cloche.network.egress.policy import Address, Policy

CONNECT_TIMEOUT_S = 10.0

_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: not global, not private


class Refused(Exception):
    """A destination the session may not reach: `rule` says which rule or check decided."""

    def __init__(self, host: str, port: int, rule: str, reason: str) -> None:
        super().__init__(f"egress to {host}:{port} refused: {rule}")
        self.host = host
        self.port = port
        self.rule = rule
        self.reason = reason  # denied, not-allowed, address, self, limit


class Unreachable(Exception):
    """An allowed destination that could not be resolved or connected to (HTTP 502)."""


@dataclass(frozen=True)
class Destination:
    """An allowed destination: the rule that allowed it and where it resolved."""

    host: str
    port: int
    rule: str
    addresses: tuple[Address, ...]


def literal(host: str) -> Address | None:
    """The address a host names literally (`10.0.0.7`, `[::1]`), else None."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def special(address: Address) -> str | None:
    """Why an address is not a public one (None when it is)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    checks = (
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("private", address.is_private),
        ("shared", address in _SHARED),
        ("multicast", address.is_multicast),
        ("unspecified", address.is_unspecified),
        ("reserved", address.is_reserved or not address.is_global),
    )
    for kind, hit in checks:
        if hit:
            return kind
    return None


async def check(policy: Policy, host: str, port: int) -> Destination:
    """The destination, once the policy allows it and its addresses pass.

    Raises:
        Refused: the policy or an address check says no.
        Unreachable: the name does not resolve.
    """
    host = host.strip().lower().rstrip(".")
    address = literal(host)
    decision = policy.decide(address if address is not None else host, port)
    if not decision.allowed:
        raise Refused(host, port, decision.rule, decision.reason)
    if address is not None:  # named by an address rule: allowed, whatever its kind
        return Destination(host, port, decision.rule, (address,))
    addresses = await _resolve(host, port)
    for found in addresses:  # any one of them: the client's resolver might pick it next
        kind = special(found)
        if kind is not None and not policy.names_address(found, port):
            why = f"{host} resolves to {found}, a {kind} address no allow rule names"
            raise Refused(host, port, why, "address")
    passing = addresses
    return Destination(host, port, decision.rule, tuple(passing))


async def connect(policy: Policy, destination: Destination) -> tuple[socket.socket, Address]:
    """A connection (a non-blocking socket) to the first of the destination's addresses that
    answers.

    Raises:
        Refused: the connection reached this machine itself, and no rule names the address.
        Unreachable: no address answered in time.
    """
    loop = asyncio.get_running_loop()
    errors = []
    for address in destination.addresses:
        family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await loop.sock_connect(sock, (str(address), destination.port))
        except (OSError, TimeoutError) as exc:
            sock.close()
            errors.append(f"{address}: {exc or 'timed out'}")
            continue
        except BaseException:
            sock.close()
            raise
        if _to_itself(sock) and not policy.names_address(address, destination.port):
            sock.close()
            raise Refused(
                destination.host,
                destination.port,
                f"{address} is this machine's own address, and no allow rule names it",
                "self",
            )
        return sock, address
    where = f"{destination.host}:{destination.port}"
    raise Unreachable(f"cannot connect to {where}: {'; '.join(errors)}")


async def _resolve(host: str, port: int) -> list[Address]:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )
    except (OSError, UnicodeError) as exc:
        raise Unreachable(f"cannot resolve {host}: {exc}") from None
    found: list[Address] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = ipaddress.ip_address(sockaddr[0])
        if address not in found:
            found.append(address)
    return found


def _to_itself(sock: socket.socket | None) -> bool:
    """Whether a connection's two ends share an address: it goes to this machine."""
    if sock is None:
        return False
    try:
        return bool(sock.getsockname()[0] == sock.getpeername()[0])
    except OSError:
        return False
