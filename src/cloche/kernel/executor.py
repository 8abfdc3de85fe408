"""Running a cell: REPL semantics over persistent globals.

The last statement, when it is an expression, is evaluated on its own and its value
becomes the cell's result (as the interactive interpreter echoes it). Tracebacks show the
user's code under `<cell-N>` names and never the kernel's own frames.

A cell may use IPython's syntax (`!ls`, `%cd`, `%%bash`, `obj?`): it is translated line by
line before it is compiled (see `ipython.py`), and its source as written is what tracebacks
show. The shell that runs those lines is `get_ipython()` in the namespace.

A cell's source stays in `linecache` (for tracebacks and `inspect`) only while something
can still run its code: a cell that defines functions, classes, lambdas or comprehensions
keeps it for the session's life, a cell of plain statements gives it up once its reply is
out. Otherwise a session running a million `i += 1` cells would hold a million sources
(~350 bytes each), and its memory limit would end it. For the same reason `%history` keeps
only the latest cells, within `HISTORY_CHARS`.
"""

from __future__ import annotations

import builtins
import collections
import linecache
import os
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .ipython import compile_cell
from .shell import MagicRunner, Shell

_KERNEL_DIR = os.path.dirname(os.path.abspath(__file__))
HISTORY_CHARS = 1 << 20  # of cell sources kept for %history (the latest cells)


@dataclass
class Outcome:
    """What a cell did: its value (when it ended on an expression) or its exception."""

    has_value: bool = False
    value: Any = None
    exception: BaseException | None = None


class History:
    """The latest cells' sources as written, by execution count, within a size."""

    def __init__(self, max_chars: int = HISTORY_CHARS) -> None:
        self.max_chars = max_chars
        self._cells: collections.deque[tuple[int, str]] = collections.deque()
        self._chars = 0

    def add(self, number: int, source: str) -> None:
        self._cells.append((number, source))
        self._chars += len(source)
        while self._chars > self.max_chars and len(self._cells) > 1:
            self._chars -= len(self._cells.popleft()[1])

    def cells(self) -> Iterator[tuple[int, str]]:
        return iter(list(self._cells))


class Executor:
    """Compiles and runs cells in one persistent namespace."""

    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self.execution_count = 0
        self.history = History()
        # get_ipython(), in the namespace
        self.shell = Shell(self.namespace, self.history, _load_magics)
        self._passing_source: str | None = None  # the linecache entry `end_cell` drops

    def run(self, source: str, in_cell: Callable[[bool], None], *, silent: bool = False) -> Outcome:
        """Run one cell. `in_cell(True)` is called right before user code runs, and
        `in_cell(False)` right after, so that interrupts land only inside the cell.

        A silent cell runs in a throwaway namespace and is not counted; of IPython's
        syntax it may use only `%pip`.
        """
        self._passing_source = None
        if silent:
            filename = "<preload>"
        else:
            self.execution_count += 1
            filename = f"<cell-{self.execution_count}>"
            linecache.cache[filename] = (len(source), None, _lines(source), filename)
            self.history.add(self.execution_count, source)
        try:
            body, tail, translated = compile_cell(source, filename, ipython=not silent)
        except BaseException as exc:  # SyntaxError, ValueError (null bytes), RecursionError...
            if not silent:
                self._passing_source = filename
            return Outcome(exception=exc)
        # A translated cell keeps its source: `%%time` and `%run` make code at run time.
        makes_code = translated or _makes_code(body) or (tail is not None and _makes_code(tail))
        if not silent and not makes_code:
            self._passing_source = filename
        namespace = {"__name__": "__preload__"} if silent else self.namespace
        try:
            in_cell(True)
            try:
                exec(body, namespace)  # noqa: S102  # running the user's code is the job
                value = eval(tail, namespace) if tail is not None else None  # noqa: S307
            finally:
                in_cell(False)
        except BaseException as exc:
            return Outcome(exception=exc)
        if tail is None or value is None or silent:
            return Outcome()
        namespace["_"] = value
        return Outcome(has_value=True, value=value)

    def end_cell(self) -> None:
        """The cell's reply is out: drop its source unless code made by it lives on."""
        if self._passing_source is not None:
            linecache.cache.pop(self._passing_source, None)
            self._passing_source = None


def _load_magics(shell: Shell) -> MagicRunner:
    """The shell's magics, imported on their first use (the kernel starts without them)."""
    from .magics import Magics

    return Magics(shell)


def _lines(source: str) -> list[str]:
    """The source's lines for linecache, each ending with a newline (as a file's would: on
    a last line without one, Python 3.11 puts a traceback's carets a column off)."""
    lines = source.splitlines(True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return lines


def _makes_code(code: types.CodeType) -> bool:
    """Whether running `code` can make functions (or classes, generators...) of its own."""
    return any(isinstance(const, types.CodeType) for const in code.co_consts)


def _user_frames(stack: traceback.StackSummary) -> traceback.StackSummary:
    """Drop the kernel's frames, and what the kernel called before the cell's own code
    (such as `ast.parse` for a SyntaxError)."""
    frames = list(stack)
    while frames and not frames[0].filename.startswith("<cell-"):
        frames.pop(0)
    return traceback.StackSummary.from_list(
        [f for f in frames if not f.filename.startswith(_KERNEL_DIR)]
    )


def _strip_kernel_frames(exc: traceback.TracebackException) -> None:
    seen: set[int] = set()
    pending: list[traceback.TracebackException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.stack = _user_frames(current.stack)
        pending += [current.__cause__, current.__context__]


def format_error(exc: BaseException) -> dict[str, Any]:
    """{ename, evalue, traceback: [lines]} for an exception, without kernel frames."""
    # A hostile __str__ or __repr__ must not break the kernel, nor cost the traceback
    # (TracebackException shows such a message as "<exception str() failed>").
    try:
        summary = traceback.TracebackException.from_exception(exc)
        _strip_kernel_frames(summary)
        lines = "".join(summary.format()).splitlines()
    except BaseException:
        lines = [f"{type(exc).__name__}: <exception could not be formatted>"]
    try:
        evalue = str(exc)
    except BaseException:
        evalue = "<exception could not be formatted>"
    return {"ename": type(exc).__name__, "evalue": evalue, "traceback": lines}
