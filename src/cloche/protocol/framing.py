"""Length-prefixed JSON frames: a 4-byte big-endian length N, then N bytes of UTF-8 JSON.

Both directions of the TCP protocol and the host side of the kernel channel use this.
A frame is always written with a single write (header and body together): two small
writes stall on Nagle's algorithm and delayed ACKs for ~40 ms.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Mapping
from typing import Any

from cloche.errors import FrameTooLarge, IncompleteRead, InvalidMessage

HEADER = struct.Struct(">I")
MAX_LENGTH = 2**32 - 1

# A lone surrogate (a str such as '\ud800', which user code can make) can't be UTF-8;
# it only ever appears inside a JSON string, where backslashreplace writes it as the
# JSON escape \ud800, so the body stays valid UTF-8 and decodes to the same str.
_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def encode_frame(message: Mapping[str, Any]) -> bytes:
    """Header and body of one frame, as one bytes object."""
    body = _encoder.encode(message).encode("utf-8", "backslashreplace")
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    """Parse a frame body into a JSON object.

    Raises:
        InvalidMessage: the body is not UTF-8, not JSON, or not an object.
    """
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidMessage("Invalid JSON format") from exc
    if not isinstance(message, dict):
        raise InvalidMessage("Invalid JSON format: the message must be a JSON object")
    return message


async def read_body(reader: asyncio.StreamReader, max_bytes: int) -> bytes | None:
    """Read one frame's body; None on a clean end of stream between frames.

    Raises:
        IncompleteRead: the stream ended inside a frame.
        FrameTooLarge: the declared length is above max_bytes (the body is not read).
    """
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise IncompleteRead("connection closed inside a frame header") from exc
    (length,) = HEADER.unpack(header)
    if length > max_bytes:
        raise FrameTooLarge(length, max_bytes)
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise IncompleteRead(
            f"connection closed after {len(exc.partial)} of {length} body bytes"
        ) from exc


class FrameDecoder:
    """Incremental decoder for a byte stream of frames (for asyncio protocols)."""

    def __init__(self, max_bytes: int) -> None:
        self._buffer = bytearray()
        self._max_bytes = max_bytes

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return the bodies of every frame now complete.

        Raises:
            FrameTooLarge: a declared length is above the maximum.
        """
        buffer = self._buffer
        buffer += data
        bodies: list[bytes] = []
        start = 0
        end = len(buffer)
        while end - start >= HEADER.size:
            (length,) = HEADER.unpack_from(buffer, start)
            if length > self._max_bytes:
                raise FrameTooLarge(length, self._max_bytes)
            if end - start - HEADER.size < length:
                break
            body_start = start + HEADER.size
            bodies.append(bytes(buffer[body_start : body_start + length]))
            start = body_start + length
        if start:
            del buffer[:start]
        return bodies

    @property
    def pending_bytes(self) -> int:
        """Bytes received that don't yet form a whole frame."""
        return len(self._buffer)
