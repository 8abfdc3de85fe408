"""A session's context: a large text or JSON value, streamed to a file in its working
directory (never through the cell channel), then loaded silently as the variable `context`.

The file is `context.txt` or `context.json` at the root of the working directory. It is
written to a fresh temporary name (O_EXCL, never following a symlink) and renamed into
place, as `cloche.sandbox.files` does, so nothing the sandbox put there is written through.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import secrets
from collections.abc import AsyncIterable, AsyncIterator
from typing import Literal

from cloche.errors import PathRefused
from cloche.sandbox.files import FILE_MODE, WorkdirFiles
from cloche.sessions.manager import SessionManager

ContextKind = Literal["text", "json"]
CONTEXT_FILES: dict[str, str] = {"text": "context.txt", "json": "context.json"}

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
_FLUSH_BYTES = 1 << 20


async def put_context(
    manager: SessionManager,
    session_id: str,
    owner: str | None,
    chunks: AsyncIterable[bytes],
    kind: ContextKind,
) -> int:
    """Stream a context into a session's working directory and load it as `context`.

    Returns:
        The context's size in bytes.

    Raises:
        SessionNotFound: unknown session, or another owner's.
        PathRefused: it is larger than the working directory (--disk-mib), or the session
            could not load it (not JSON, or over --memory-mib).
    """
    name = CONTEXT_FILES[kind]
    writer = _Writer(await manager.files(session_id, owner), name)
    await asyncio.to_thread(writer.open)
    try:
        buffer = bytearray()
        async for chunk in chunks:
            buffer += chunk
            if len(buffer) >= _FLUSH_BYTES:
                await asyncio.to_thread(writer.write, bytes(buffer))
                buffer.clear()
        await asyncio.to_thread(writer.write, bytes(buffer))
        await asyncio.to_thread(writer.finish)
    finally:
        await asyncio.to_thread(writer.discard)
    code = f"import cloche.kernel.llm as _llm\n_llm.load_context({name!r}, {kind!r})\n"
    result = await manager.execute(session_id, code, owner=owner, silent=True)
    if result.status.value != "ok":
        if result.error is not None and result.error["ename"] == "MemoryError":
            why = "the session ran out of memory loading it; raise --memory-mib"
        elif result.error is not None:
            why = f"{result.error['ename']}: {result.error['evalue']}"[:500]
        else:
            why = result.message or result.status.value
        raise PathRefused(name, f"the session could not load it as {kind}: {why}")
    return writer.size


async def put_context_value(
    manager: SessionManager, session_id: str, owner: str | None, value: object
) -> int:
    """Put a value as the session's context: a str as text, anything else as JSON."""
    kind: ContextKind = "text" if isinstance(value, str) else "json"
    data = await asyncio.to_thread(_encode, value)  # megabytes: not on the event loop

    async def one() -> AsyncIterator[bytes]:
        yield data

    return await put_context(manager, session_id, owner, one(), kind)


def _encode(value: object) -> bytes:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")


class _Writer:
    """The file being written at the root of a working directory (blocking methods)."""

    def __init__(self, files: WorkdirFiles, name: str) -> None:
        self.files = files
        self.name = name
        self.size = 0
        self._root = -1
        self._fd = -1
        self._temp: str | None = None

    def open(self) -> None:
        self._root = os.open(self.files.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        for _ in range(8):
            temp = f".cloche-{secrets.token_hex(8)}.tmp"
            try:
                self._fd = os.open(temp, _CREATE_FLAGS, 0o600, dir_fd=self._root)
            except FileExistsError:
                continue  # the sandbox is squatting names; draw another
            except OSError as exc:
                raise self._refused(exc) from exc
            self._temp = temp
            return
        raise PathRefused(self.name, "no free temporary name in the working directory")

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.files.max_file_bytes:
            raise PathRefused(
                self.name,
                f"the context is over {self.files.max_file_bytes} bytes, the size of the "
                "working directory (--disk-mib)",
            )
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            raise self._refused(exc) from exc

    def finish(self) -> None:
        """Give the file to the sandbox's user and rename it into place."""
        uid, gid = self.files.uid, self.files.gid
        if uid is not None or gid is not None:
            os.fchown(self._fd, uid if uid is not None else -1, gid if gid is not None else -1)
        os.fchmod(self._fd, FILE_MODE)
        os.close(self._fd)
        self._fd = -1
        assert self._temp is not None
        try:
            # rename replaces whatever the sandbox put there (a symlink too): never follows it.
            os.rename(self._temp, self.name, src_dir_fd=self._root, dst_dir_fd=self._root)
        except OSError as exc:
            raise self._refused(exc) from exc
        self._temp = None

    def discard(self) -> None:
        """Close what is open, and remove the temporary file if it is still ours."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._temp is not None:
            try:
                os.unlink(self._temp, dir_fd=self._root)
            except OSError:
                pass
            self._temp = None
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    def _refused(self, exc: OSError) -> PathRefused:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return PathRefused(self.name, "the working directory is full; raise --disk-mib")
        return PathRefused(self.name, f"it can't be written: {exc.strerror}")
