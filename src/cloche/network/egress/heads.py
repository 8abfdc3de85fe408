"""HTTP at the door: request heads read, heads made to send upstream, the door's own answers.

A request is one head, read whole (within the proxy's limit); one that can't be read is a
BadRequest (HTTP 400). What goes upstream is one request only, as `Connection: close`,
without the hop-by-hop headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse

from cloche.network.egress import guard

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "upgrade"}
)


class BadRequest(Exception):
    """A request this proxy cannot read (HTTP 400)."""


def parse_head(head: bytes) -> tuple[str, str, list[str]]:
    """The method, the target and the header lines of a request head."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover (latin-1 decodes any byte)
        raise BadRequest("the request head is not text") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(f"not an HTTP/1.x request line: {lines[0][:200]!r}")
    return parts[0].upper(), parts[1], [line for line in lines[1:] if line]


def destination_of(method: str, target: str, lines: list[str]) -> tuple[str, int, bytes | None]:
    """(host, port, the head to send upstream, or None for a tunnel)."""
    if method == "CONNECT":
        host, port = _host_port(target, None)
        return host, port, None
    url = urllib.parse.urlsplit(target)
    if url.scheme != "http" or not url.hostname:
        raise BadRequest(
            "this is cloche's egress proxy: send it absolute http:// URLs, or CONNECT "
            f"host:port for anything else (got {target[:200]!r})"
        )
    try:
        port = url.port or 80
    except ValueError:
        raise BadRequest(f"a bad port in {target[:200]!r}") from None
    path = urllib.parse.urlunsplit(("", "", url.path or "/", url.query, ""))
    return url.hostname, port, origin_head(method, path, lines, url.netloc.rpartition("@")[2])


def origin_head(method: str, path: str, lines: list[str], host: str) -> bytes:
    """A request head to send upstream: hop-by-hop headers dropped, one request only."""
    headers = [line for line in lines if line.split(":", 1)[0].strip().lower() not in _HOP_BY_HOP]
    if not any(line.lower().startswith("host:") for line in headers):
        headers.insert(0, f"Host: {host}")
    head = "\r\n".join([f"{method} {path} HTTP/1.1", *headers, "Connection: close", "", ""])
    return head.encode("latin-1")


def _host_port(target: str, default: int | None) -> tuple[str, int]:
    host, _, port_text = target.rpartition(":")
    if not host or (host.count(":") and not host.startswith("[")):
        raise BadRequest(f"CONNECT wants host:port, not {target[:200]!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise BadRequest(f"CONNECT wants host:port, not {target[:200]!r}") from None
    if not 0 < port < 65536:
        raise BadRequest(f"port {port} is out of range")
    return host.strip("[]"), port


def status_of(chunk: bytes) -> int | None:
    """The status code of an answer's first bytes, when they start with a status line."""
    line = chunk.split(b"\r\n", 1)[0].split(b" ")
    if len(line) >= 2 and line[0].startswith(b"HTTP/") and line[1].isdigit():
        return int(line[1])
    return None


async def answer(
    writer: asyncio.StreamWriter,
    status: int,
    phrase: str,
    text: str,
    refused: guard.Refused | None,
) -> None:
    """A short HTTP answer from the proxy itself; the connection ends after it."""
    body = (text + "\n").encode()
    headers = [
        f"HTTP/1.1 {status} {phrase}",
        "Content-Type: text/plain; charset=utf-8",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if refused is not None:
        rule = refused.rule.replace('"', "'")
        headers.append(
            f'X-Cloche-Egress: refused; host="{refused.host}"; port={refused.port}; '
            f'reason={refused.reason}; rule="{rule}"'
        )
    writer.write("\r\n".join([*headers, "", ""]).encode("latin-1", "replace") + body)
    with contextlib.suppress(ConnectionError, OSError):
        await writer.drain()
