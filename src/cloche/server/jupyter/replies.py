"""Replies the gateway gives without running a cell: kernel_info, is_complete, and history
(from the session's history, which the session manager keeps)."""

from __future__ import annotations

import codeop
import fnmatch
import platform
import re
import warnings
from collections.abc import Sequence
from typing import Any

from cloche import __version__
from cloche.server.jupyter.messages import PROTOCOL_VERSION
from cloche.sessions.history import CellEntry

MAX_IS_COMPLETE_CHARS = 64 * 1024  # longer code is answered "unknown", not compiled
DEFAULT_HISTORY_N = 10  # cells of a `tail` history request that says no n (IPython's)
# A history request's `session`: the kernel's cells are all of session 0, the current one,
# numbered by their number in the session's history (a restart goes on counting).
HISTORY_SESSION = 0
# IPython syntax that the kernel translates (`!ls`, `%time x`, `x = !ls`, `obj?`): codeop
# would call it invalid, so each such line is read as a plain statement.
_SHELL_OR_MAGIC = re.compile(r"^(\s*)[!%].*$")
_ASSIGNED_SHELL = re.compile(r"^(\s*[\w.]+\s*=\s*)!.*$")
_HELP = re.compile(r"^(\s*[\w.]+)\?\??\s*$")


def kernel_info() -> dict[str, Any]:
    """The content of kernel_info_reply."""
    version = platform.python_version()
    return {
        "status": "ok",
        "protocol_version": PROTOCOL_VERSION,
        "implementation": "cloche",
        "implementation_version": __version__,
        "language_info": {
            "name": "python",
            "version": version,
            "mimetype": "text/x-python",
            "file_extension": ".py",
            "pygments_lexer": "ipython3",
            "codemirror_mode": {"name": "ipython", "version": 3},
            "nbconvert_exporter": "python",
        },
        "banner": f"cloche {__version__}: Python {version} in a gVisor sandbox",
        "help_links": [],
        "debugger": False,
    }


def is_complete(code: str) -> dict[str, Any]:
    """The content of is_complete_reply: complete, incomplete (with the next line's indent),
    invalid, or unknown (too long to look at here)."""
    if len(code) > MAX_IS_COMPLETE_CHARS:
        return {"status": "unknown"}
    if code.lstrip().startswith("%%"):
        return {"status": "complete"}  # a cell magic: its body is not Python
    source = "\n".join(_as_python(line) for line in code.split("\n"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning about escapes: not ours to tell
            compiled = codeop.compile_command(source, "<cell>", "exec")
    except (SyntaxError, OverflowError, ValueError):
        return {"status": "invalid"}
    if compiled is not None:
        return {"status": "complete"}
    return {"status": "incomplete", "indent": _next_indent(code)}


def _as_python(line: str) -> str:
    if match := _ASSIGNED_SHELL.match(line):
        return f"{match[1]}None"
    if match := _SHELL_OR_MAGIC.match(line):
        return f"{match[1]}pass"
    if match := _HELP.match(line):
        return match[1]
    return line


def _next_indent(code: str) -> str:
    lines = [line for line in code.split("\n") if line.strip()]
    if not lines:
        return ""
    last = lines[-1]
    indent = last[: len(last) - len(last.lstrip())]
    return indent + "    " if last.rstrip().endswith(":") else indent


def history(cells: Sequence[CellEntry], content: dict[str, Any]) -> list[list[Any]]:
    """The `history` of a history_reply: [session, line, input], or [session, line, [input,
    output]] with `output` (the output: the text/plain result, else stdout, else None).

    `hist_access_type` as IPython reads it: `tail` (the last n), `range` (session 0's lines
    start <= line < stop; a negative start or stop counts from the end, no stop: to the
    end), `search` (`pattern` as a case-sensitive glob on the code, the last n matches if
    n, each code once if unique). Lines are the cells' numbers (`CellEntry.number`).
    """
    kind = content.get("hist_access_type")
    n = _int(content.get("n"))
    if kind == "tail":
        count = DEFAULT_HISTORY_N if n is None else n
        found = list(cells[-count:]) if count > 0 else []
    elif kind == "range":
        found = _range(cells, content) if _int(content.get("session")) in (None, 0) else []
    elif kind == "search":
        pattern = content.get("pattern")
        pattern = pattern if isinstance(pattern, str) else "*"
        found = [c for c in cells if fnmatch.fnmatchcase(c.code, pattern)]
        if content.get("unique") is True:
            latest = {c.code: c.number for c in found}
            found = [c for c in found if latest[c.code] == c.number]
        if n is not None:
            found = found[-n:] if n > 0 else []
    else:
        found = []
    if content.get("output") is True:
        return [[HISTORY_SESSION, c.number, [c.code, _output(c)]] for c in found]
    return [[HISTORY_SESSION, c.number, c.code] for c in found]


def _range(cells: Sequence[CellEntry], content: dict[str, Any]) -> list[CellEntry]:
    end = (cells[-1].number if cells else 0) + 1  # one past the last line, as IPython's n
    start = _int(content.get("start")) or 1
    if start < 0:
        start += end
    stop = _int(content.get("stop"))
    if not stop or stop > end:
        stop = end
    elif stop < 0:
        stop += end
    return [c for c in cells if start <= c.number < stop]


def _output(cell: CellEntry) -> str | None:
    result = (cell.result or {}).get("text/plain")
    if isinstance(result, str):
        return result
    return cell.stdout or None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
