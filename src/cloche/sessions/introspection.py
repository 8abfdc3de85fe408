"""Completions and help of a live session, for front ends that ask for them (Jupyter's
complete and inspect requests; its history requests are answered from the session's own
history, `sessions.history`).

Each is one silent cell, queued behind the session's cells as ipykernel answers them in turn:
it runs in a namespace of its own, is not counted, and calls `cloche.kernel.introspect` on
the session's real namespace; the answer comes back as one line of JSON on its stdout. The
kernel is hostile: an answer of the wrong shape is an empty answer, never an exception.
"""

from __future__ import annotations

import json
from typing import Any

from cloche.sessions.manager import SessionManager

_ASK = (
    "import json as _json\n"
    "from cloche.kernel import introspect as _introspect\n"
    "print(_json.dumps(_introspect.{call}))"
)
INTROSPECT_TIMEOUT_S = 10.0


async def _ask(manager: SessionManager, session_id: str, owner: str | None, call: str) -> Any:
    result = await manager.execute(
        session_id,
        _ASK.format(call=call),
        owner=owner,
        timeout_s=INTROSPECT_TIMEOUT_S,
        silent=True,
    )
    if result.error is not None:
        return None
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


async def complete(
    manager: SessionManager, session_id: str, code: str, cursor_pos: int, owner: str | None
) -> dict[str, Any]:
    """{"matches": [str], "cursor_start", "cursor_end"} at the cursor.

    Raises:
        SessionNotFound: as execute does.
    """
    answer = await _ask(manager, session_id, owner, f"complete({code!r}, {int(cursor_pos)})")
    empty = {"matches": [], "cursor_start": cursor_pos, "cursor_end": cursor_pos}
    if not isinstance(answer, dict) or not isinstance(answer.get("matches"), list):
        return empty
    try:
        return {
            "matches": [str(m) for m in answer["matches"]],
            "cursor_start": int(answer["cursor_start"]),
            "cursor_end": int(answer["cursor_end"]),
        }
    except (KeyError, TypeError, ValueError):
        return empty


async def inspect(
    manager: SessionManager,
    session_id: str,
    code: str,
    cursor_pos: int,
    detail_level: int,
    owner: str | None,
) -> str | None:
    """The help text of the name at the cursor; None when there is none.

    Raises:
        SessionNotFound: as execute does.
    """
    call = f"inspect({code!r}, {int(cursor_pos)}, {1 if detail_level else 0})"
    answer = await _ask(manager, session_id, owner, call)
    if isinstance(answer, dict) and answer.get("found") is True:
        return str(answer.get("text", ""))
    return None
