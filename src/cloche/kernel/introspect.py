"""What a Jupyter client asks of the live session besides running cells: completions, and
help on a name (its past cells are the host's: `sessions.history`). The host asks through a
silent cell (a namespace of its own, not counted), which calls these on the session's real
namespace and returns JSON.

    complete(code, cursor_pos) -> {"matches", "cursor_start", "cursor_end"}
    inspect(code, cursor_pos, detail_level) -> {"found", "text"}

Nothing here runs the user's code, except what attribute lookups on the user's objects do.
"""

from __future__ import annotations

import keyword
import re
import rlcompleter
from typing import Any

from .executor import Executor
from .inspection import _NOT_FOUND, describe, find

_executor: Executor | None = None
_MAX_MATCHES = 1000
# The dotted name that ends at the cursor: `np.lin` in `x = np.lin|`.
_TAIL = re.compile(r"[A-Za-z_][\w.]*$|$")
# The dotted name around (or just before) the cursor, for help: `np.linspace(` -> np.linspace.
_AROUND = re.compile(r"[A-Za-z_][\w.]*")


def bind(executor: Executor) -> None:
    """The kernel's executor: whose namespace and history are asked about."""
    global _executor
    _executor = executor


def _namespace() -> dict[str, Any]:
    assert _executor is not None, "the kernel binds its executor at start"
    return _executor.namespace


def complete(code: str, cursor_pos: int) -> dict[str, Any]:
    """Names and attributes that complete the dotted name before the cursor."""
    before = code[: max(0, min(cursor_pos, len(code)))]
    tail = _TAIL.search(before)
    text = tail.group(0) if tail else ""
    start = len(before) - len(text)
    matches: list[str] = []
    if text or before.endswith((" ", "(", "[", ",", "=", "\n")) or not before:
        completer = rlcompleter.Completer(_namespace())
        for state in range(_MAX_MATCHES):
            try:
                match = completer.complete(text, state)
            except Exception:  # a hostile __dir__ or property: no completions from it
                break
            if match is None:
                break
            matches.append(match.rstrip("(") if keyword.iskeyword(match.rstrip()) else match)
    unique = list(dict.fromkeys(m.rstrip() for m in matches))
    return {"matches": unique, "cursor_start": start, "cursor_end": len(before)}


def inspect(code: str, cursor_pos: int, detail_level: int = 0) -> dict[str, Any]:
    """The help text (`name?`, or `name??` with detail_level 1) of the name at the cursor."""
    name = _name_at(code, max(0, min(cursor_pos, len(code))))
    if not name:
        return {"found": False, "text": ""}
    value = find(name, _namespace())
    if value is _NOT_FOUND:
        return {"found": False, "text": ""}
    return {"found": True, "text": describe(value, name, detail_level)}


def _name_at(code: str, cursor: int) -> str:
    """The dotted name under the cursor, else the callable whose call the cursor is in."""
    for match in _AROUND.finditer(code):
        if match.start() <= cursor <= match.end():
            return match.group(0).rstrip(".")
    depth = 0
    for index in range(cursor - 1, -1, -1):  # inside `f(a, |`: f
        char = code[index]
        if char == ")":
            depth += 1
        elif char == "(":
            if depth == 0:
                names = list(_AROUND.finditer(code[:index]))
                if names and names[-1].end() == index:
                    return names[-1].group(0)
                return ""
            depth -= 1
    return ""
