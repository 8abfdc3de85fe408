"""This process's input, read without blocking the event loop: what `cloche exec` passes to a
command's stdin and `cloche shell` types into a terminal.

A terminal, a pipe or a socket is watched by the loop (its file stays blocking: a terminal
shares it with stdout, whose writes must not fail with EAGAIN); a regular file or another
device, which the loop can't watch, is read in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import AsyncIterator

CHUNK_BYTES = 64 * 1024
HELD_CHUNKS = 16  # read ahead at most this many pieces, then wait for them to be taken


def watchable(fd: int) -> bool:
    """Whether the event loop can wait for fd to be readable."""
    mode = os.fstat(fd).st_mode
    return os.isatty(fd) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


async def chunks(fd: int) -> AsyncIterator[bytes]:
    """What can be read from fd, piece by piece as it comes, until its end."""
    if not watchable(fd):
        while piece := await asyncio.to_thread(os.read, fd, CHUNK_BYTES):
            yield piece
        return
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue[bytes] = asyncio.Queue()
    watching = True
    ended = False

    def readable() -> None:
        nonlocal watching, ended
        try:
            piece = os.read(fd, CHUNK_BYTES)
        except BlockingIOError:
            return
        except OSError:  # a terminal gone (EIO): its end
            piece = b""
        ended = not piece
        if ended or pieces.qsize() + 1 >= HELD_CHUNKS:
            loop.remove_reader(fd)
            watching = False
        pieces.put_nowait(piece)

    loop.add_reader(fd, readable)
    try:
        while piece := await pieces.get():
            if not watching and not ended and pieces.qsize() < HELD_CHUNKS // 2:
                loop.add_reader(fd, readable)
                watching = True
            yield piece
    finally:
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(fd)
