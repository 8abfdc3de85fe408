"""HTTP/1.1 on a connection to a server inside the sandbox: the request as cloche writes it,
the answer as cloche reads it.

A request is written afresh from what the front end parsed (never the client's bytes as
they came): its own head, its body framed by Content-Length or chunked, one request at a
time. So no request of one client can hide inside another's, and what reaches a server is
what cloche meant to send. The answer is untrusted (the server is the session's): its head
is bounded and checked, its body framed by the rules of RFC 9112 (no body for HEAD, 1xx, 204
and 304; chunked over Content-Length; else to the end), and an answer that breaks them is a
`BadResponse`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

HEAD_LIMIT_BYTES = 64 * 1024  # an answer's status line and headers, at most
MAX_HEADERS = 256
CHUNK_BYTES = 1024 * 1024  # a body is passed on in pieces of at most this
CHUNK_LINE_BYTES = 4096  # a chunk's size line (extensions included), at most
MAX_TRAILERS = 64
# Headers of one hop, never passed on as they are (RFC 9110 7.6.1).
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_STATUS_LINE = re.compile(rb"^HTTP/1\.([01]) ([1-9][0-9]{2})(?: (.*))?$")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_TARGET = re.compile(rb"^/[\x21-\x7e]*$")


class BadResponse(Exception):
    """A server's answer that is not HTTP/1.x cloche can pass on."""


def is_token(name: bytes) -> bool:
    return bool(_TOKEN.match(name))


def clean_value(value: bytes) -> bool:
    """Whether a header value is safe to pass on (no line breaks, NULs or controls)."""
    return not _BAD_VALUE.search(value)


def request_head(method: str, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """A request's head. Raises ValueError for a method, target or header that could make
    more than one request of it."""
    raw = method.encode("ascii", "replace")
    if not is_token(raw):
        raise ValueError(f"not a method: {method!r}")
    if not _TARGET.match(target):
        raise ValueError("a request target is a path of visible ASCII")
    lines = [raw + b" " + target + b" HTTP/1.1"]
    for name, value in headers:
        if not is_token(name) or not clean_value(value):
            raise ValueError(f"a header that can't be sent: {name[:40]!r}")
        lines.append(name + b": " + value)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def chunk(data: bytes) -> bytes:
    """A piece of a chunked body (never empty: that would end it)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


@dataclass
class Head:
    """A response's status line and headers (names in lower case)."""

    status: int
    reason: bytes
    minor: int  # HTTP/1.<minor>
    headers: list[tuple[bytes, bytes]]

    def values(self, name: bytes) -> list[bytes]:
        return [v for n, v in self.headers if n == name]

    def tokens(self, name: bytes) -> set[bytes]:
        """A list header's tokens, in lower case (Connection, Transfer-Encoding)."""
        return {
            part.strip().lower()
            for v in self.values(name)
            for part in v.split(b",")
            if part.strip()
        }


async def read_head(reader: asyncio.StreamReader) -> Head:
    """The next response head on the connection.

    Raises:
        BadResponse: malformed, too large, or the connection ended first.
    """
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        why = "closed the connection without answering" if not exc.partial else "sent half a head"
        raise BadResponse(why) from None
    except asyncio.LimitOverrunError:
        raise BadResponse(f"sent a head larger than {HEAD_LIMIT_BYTES} bytes") from None
    if len(raw) > HEAD_LIMIT_BYTES:
        raise BadResponse(f"sent a head larger than {HEAD_LIMIT_BYTES} bytes")
    lines = raw[:-4].split(b"\r\n")
    match = _STATUS_LINE.match(lines[0])
    if match is None:
        raise BadResponse(f"sent no HTTP/1.x status line: {lines[0][:60]!r}")
    if len(lines) - 1 > MAX_HEADERS:
        raise BadResponse(f"sent more than {MAX_HEADERS} headers")
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not is_token(name):  # obs-fold, a space before the colon, ...
            raise BadResponse(f"sent a malformed header line: {line[:60]!r}")
        value = value.strip(b" \t")
        if not clean_value(value):
            raise BadResponse(f"sent a header value with control characters: {name[:40]!r}")
        headers.append((name.lower(), value))
    return Head(int(match[2]), match[3] or b"", int(match[1]), headers)


@dataclass(frozen=True)
class Framing:
    """How a response's body ends: none, after `length` bytes, chunked, or at the close."""

    kind: str  # "none" | "length" | "chunked" | "close"
    length: int = 0


def framing(head: Head, method: str) -> Framing:
    """The body's framing (RFC 9112 6.3). Raises BadResponse for a Content-Length that is
    not one number."""
    if method == "HEAD" or head.status < 200 or head.status in (204, 304):
        return Framing("none")
    if head.values(b"transfer-encoding"):
        last = head.values(b"transfer-encoding")[-1].split(b",")[-1].strip().lower()
        return Framing("chunked") if last == b"chunked" else Framing("close")
    lengths = {v.strip() for v in head.values(b"content-length")}
    if not lengths:
        return Framing("close")
    if len(lengths) > 1 or not all(v.isdigit() for v in lengths) or len(next(iter(lengths))) > 18:
        raise BadResponse(f"sent a Content-Length that is not one number: {sorted(lengths)!r}")
    return Framing("length", int(next(iter(lengths))))


def reusable(head: Head, frame: Framing) -> bool:
    """Whether the connection may carry another request after this response's body."""
    return (
        head.minor == 1
        and frame.kind in ("none", "length", "chunked")
        and b"close" not in head.tokens(b"connection")
        and not (frame.kind == "chunked" and head.values(b"content-length"))
    )


async def body(reader: asyncio.StreamReader, frame: Framing) -> AsyncGenerator[bytes, None]:
    """A response body's pieces as they come (chunked: decoded).

    Raises:
        BadResponse: it ended early, or its chunks are malformed.
    """
    if frame.kind == "length":
        left = frame.length
        while left:
            data = await reader.read(min(left, CHUNK_BYTES))
            if not data:
                raise BadResponse(f"ended its body {left} bytes short of its Content-Length")
            left -= len(data)
            yield data
    elif frame.kind == "close":
        while data := await reader.read(CHUNK_BYTES):
            yield data
    elif frame.kind == "chunked":
        async for data in _chunks(reader):
            yield data


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    try:
        while True:
            line = await reader.readuntil(b"\n")
            size_text = line.split(b";", 1)[0].strip()
            if len(line) > CHUNK_LINE_BYTES or not size_text or len(size_text) > 15:
                raise BadResponse("sent a malformed chunk size")
            try:
                left = int(size_text, 16)
            except ValueError:
                raise BadResponse("sent a malformed chunk size") from None
            if left == 0:
                break
            while left:
                data = await reader.read(min(left, CHUNK_BYTES))
                if not data:
                    raise BadResponse("ended in the middle of a chunk")
                left -= len(data)
                yield data
            if await reader.readexactly(2) != b"\r\n":
                raise BadResponse("sent a chunk longer than its size")
        for _ in range(MAX_TRAILERS + 1):  # trailers: read, not passed on
            if (await reader.readuntil(b"\n")).strip() == b"":
                return
        raise BadResponse(f"sent more than {MAX_TRAILERS} trailers")
    except asyncio.IncompleteReadError:
        raise BadResponse("ended in the middle of its chunked body") from None
    except asyncio.LimitOverrunError:
        raise BadResponse("sent a chunk size line that never ends") from None
