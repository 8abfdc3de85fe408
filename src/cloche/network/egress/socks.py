"""SOCKS5 at the door: a CONNECT (no authentication; an address or a name), for TCP that
is not HTTP (a database on a port the policy allows), and the door's replies to it.
"""

from __future__ import annotations

import asyncio
import ipaddress

from cloche.network.egress.heads import BadRequest

SOCKS5 = b"\x05"
SOCKS_OK, _FAILURE, SOCKS_NOT_ALLOWED, SOCKS_UNREACHABLE = 0, 1, 2, 4
_NO_COMMAND, _NO_ADDRESS_TYPE = 7, 8


async def socks_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> tuple[str, int]:
    """A SOCKS5 greeting (no authentication) and CONNECT request, after its first byte:
    (host, port). A request refused here is answered here (then BadRequest)."""
    methods = await reader.readexactly((await reader.readexactly(1))[0])
    if 0 not in methods:
        writer.write(b"\x05\xff")
        raise BadRequest("SOCKS5 without its no-authentication method")
    writer.write(b"\x05\x00")
    version, command, _, kind = await reader.readexactly(4)
    if version != 5 or command != 1:
        writer.write(socks_reply(_NO_COMMAND))
        raise BadRequest("SOCKS5: only CONNECT is served")
    if kind == 1:
        host = str(ipaddress.IPv4Address(await reader.readexactly(4)))
    elif kind == 4:
        host = str(ipaddress.IPv6Address(await reader.readexactly(16)))
    elif kind == 3:
        name = await reader.readexactly((await reader.readexactly(1))[0])
        try:
            host = name.decode("ascii")
        except UnicodeDecodeError:
            writer.write(socks_reply(_FAILURE))
            raise BadRequest("SOCKS5: a host name that is not ASCII") from None
    else:
        writer.write(socks_reply(_NO_ADDRESS_TYPE))
        raise BadRequest(f"SOCKS5: unknown address type {kind}")
    port = int.from_bytes(await reader.readexactly(2), "big")
    if not port:
        writer.write(socks_reply(_FAILURE))
        raise BadRequest("SOCKS5: port 0")
    return host, port


def socks_reply(code: int) -> bytes:
    """A SOCKS5 reply with code (no bound address given)."""
    return bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])
