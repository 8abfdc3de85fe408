"""Replies the gateway gives without running a cell: kernel_info, is_complete, and the
requests this slice answers with nothing found (complete, inspect, history)."""

from __future__ import annotations

import codeop
import platform
import re
import warnings
from typing import Any

from cloche import __version__
from cloche.server.jupyter.messages import PROTOCOL_VERSION

MAX_IS_COMPLETE_CHARS = 64 * 1024  # longer code is answered "unknown", not compiled
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
