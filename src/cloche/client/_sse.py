"""Server-Sent Events, read line by line (the subset the sessions API sends)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any


async def events(lines: AsyncIterable[str]) -> AsyncIterator[tuple[str, Any]]:
    """(event name, JSON-decoded data) for each complete event; comments are skipped."""
    name: str | None = None
    data: list[str] = []
    async for line in lines:
        if line == "":
            if data:
                yield name or "message", json.loads("\n".join(data))
            name, data = None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            name = line.removeprefix("event:").removeprefix(" ")
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").removeprefix(" "))
