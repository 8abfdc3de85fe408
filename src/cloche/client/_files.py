"""A file's content as the client takes it, its path in a URL, and a local file streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import quote

FileData = bytes | str  # str is written as UTF-8


def encode(data: FileData) -> bytes:
    """The bytes of a file's content."""
    return data.encode() if isinstance(data, str) else bytes(data)


def file_url(path: str) -> str:
    """A working-directory path as URL segments; `.` and `..` escaped so that they reach
    the server (which refuses them) instead of being resolved on the way."""
    segments = [quote(part, safe="") for part in path.split("/")]
    return "/".join(part.replace(".", "%2E") if part in (".", "..") else part for part in segments)


async def file_chunks(path: str) -> AsyncIterator[bytes]:
    """A file's content in pieces, read in a thread."""
    file = await asyncio.to_thread(open, path, "rb")
    try:
        while chunk := await asyncio.to_thread(file.read, 1 << 20):
            yield chunk
    finally:
        file.close()
