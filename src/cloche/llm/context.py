"""A session's context: a large text or JSON value, streamed to a file in its working
directory (never through the cell channel), then loaded silently as the variable `context`.

The file is `context.txt` or `context.json` at the root of the working directory, written
through the manager (`SessionManager.write_stream`) as any file a client sends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Literal

from cloche.errors import PathRefused
from cloche.sessions.manager import SessionManager

ContextKind = Literal["text", "json"]
CONTEXT_FILES: dict[str, str] = {"text": "context.txt", "json": "context.json"}


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
    size = await manager.write_stream(session_id, name, chunks, owner)
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
    return size


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
