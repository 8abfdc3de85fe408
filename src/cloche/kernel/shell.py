"""What `get_ipython()` returns in a cell: the part of IPython's shell the kernel offers.

Shell commands (`!cmd`, `x = !cmd`, `%%bash`) run as `/bin/sh -c CMD` in the sandbox (see
`processes.py`), their `{expr}` and `$name` expanded first (see `expansion.py`). Magics
are the shell's through the loader it is given (`magics.py`, loaded on first use).
"""

from __future__ import annotations

import builtins
import os
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from .expansion import expand
from .ipython import SHELL
from .processes import SH, run_command


class SList(list[str]):
    """The lines a command printed (`x = !cmd`), as IPython's SList.

    `.n` joins them with newlines, `.s` with spaces; `.l` (or `.list`) is the list itself;
    `.grep(pattern)` keeps the lines matching a regex (case-insensitive) or a predicate.
    """

    @property
    def l(self) -> SList:  # noqa: E743  # IPython's name
        return self

    @property
    def list(self) -> SList:
        return self

    @property
    def n(self) -> str:
        return "\n".join(self)

    nlstr = n

    @property
    def s(self) -> str:
        return " ".join(self)

    spstr = s

    @property
    def p(self) -> builtins.list[Any]:
        """The lines that name existing paths, as pathlib paths."""
        import pathlib

        return [pathlib.Path(line) for line in self if os.path.exists(line)]

    def grep(
        self,
        pattern: str | Callable[[str], Any],
        prune: bool = False,
        field: int | None = None,
    ) -> SList:
        """The lines that match (or, with `prune`, that don't); `field` matches one
        whitespace-separated field of each line instead of the whole line."""

        def target(line: str) -> str:
            if field is None:
                return line
            parts = line.split()
            return parts[field] if -len(parts) <= field < len(parts) else ""

        def matches(line: str) -> bool:
            if isinstance(pattern, str):
                return re.search(pattern, target(line), re.IGNORECASE) is not None
            return bool(pattern(target(line)))

        return SList(line for line in self if matches(line) != prune)

    def fields(self, *numbers: int) -> SList:
        """The given whitespace-separated fields of each line, joined by spaces (all
        fields when none are given)."""
        out = SList()
        for line in self:
            parts = line.split()
            if not numbers:
                out.append(" ".join(parts))
                continue
            out.append(" ".join(parts[n] for n in numbers if -len(parts) <= n < len(parts)))
        return out


class History(Protocol):
    """The session's cells, as `%history` reads them."""

    def cells(self) -> Iterable[tuple[int, str]]: ...


class MagicRunner(Protocol):
    """What the shell asks of its magics (`magics.Magics`); `place` is theirs to read."""

    def place(self, depth: int, text: str | None) -> Any: ...

    def run_line(self, name: str, line: str, place: Any) -> Any: ...

    def run_cell(self, name: str, line: str, cell: str, place: Any) -> Any: ...

    def help_text(self, target: str, detail_level: int, namespace: dict[str, Any]) -> str: ...


class Shell:
    """The session's shell: runs commands and magics for the cell's IPython syntax.

    Args:
        user_ns: the session's namespace (`get_ipython().user_ns`).
        history: the session's cells so far, for `%history`.
        load_magics: makes the shell's magics, on their first use (the kernel starts
            without them).
    """

    def __init__(
        self,
        user_ns: dict[str, Any],
        history: History,
        load_magics: Callable[[Shell], MagicRunner],
    ) -> None:
        self.user_ns = user_ns
        self.history = history
        # Where `obj?` sends its text: a Jupyter client's pager (IPython's `page` payload)
        # when the cell's client has one, else None and the text is printed.
        self.pager: Callable[[str], None] | None = None
        self._load_magics = load_magics
        self._magics: MagicRunner | None = None
        self.install(user_ns)

    @property
    def magics(self) -> MagicRunner:
        """The magics, loaded on first use (the kernel starts without them)."""
        if self._magics is None:
            self._magics = self._load_magics(self)
        return self._magics

    def install(self, namespace: dict[str, Any]) -> None:
        """Put the shell, and `get_ipython`, in a namespace that runs cells."""
        namespace[SHELL] = self
        namespace["get_ipython"] = self.get_ipython

    def get_ipython(self) -> Shell:
        """The session's shell, as IPython's `get_ipython()`."""
        return self

    # -- shell commands ---------------------------------------------------------------------

    def system(self, cmd: str) -> None:
        """Run a shell command, its output streamed as the cell's; `_exit_code` is set."""
        command = self.var_expand(cmd, depth=1)
        code, _ = run_command([SH, "-c", command], capture=False)
        if code > 128:  # the shell reports a child killed by signal N as 128 + N
            code = -(code - 128)
        self.user_ns["_exit_code"] = code

    def getoutput(self, cmd: str, split: bool = True, depth: int = 0) -> SList | str:
        """Run a shell command and return its output (stdout and stderr) as lines."""
        command = self.var_expand(cmd, depth=depth + 1)
        _, output = run_command([SH, "-c", command], capture=True)
        return SList(output.splitlines()) if split else output

    def var_expand(self, cmd: str, depth: int = 0) -> str:
        """The command with `{expr}` and `$name` expanded in the namespace of the code
        `depth` frames above the caller."""
        return expand(cmd, self.namespace_at(depth + 1))

    def namespace_at(self, depth: int) -> dict[str, Any]:
        """The user's namespace merged with the locals of the frame `depth` above the caller."""
        namespace = dict(self.user_ns)
        frame = sys._getframe(depth + 1)
        if frame.f_locals is not frame.f_globals:
            namespace.update(frame.f_locals)
        return namespace

    # -- magics -----------------------------------------------------------------------------

    def run_line_magic(self, magic_name: str, line: str, _stack_depth: int = 1) -> Any:
        """Run `%magic_name line`, as IPython's method of that name."""
        return self.magics.run_line(magic_name, line, self.magics.place(_stack_depth, None))

    def run_cell_magic(self, magic_name: str, line: str, cell: str) -> Any:
        """Run a `%%magic_name line` cell, as IPython's method of that name."""
        return self.magics.run_cell(magic_name, line, cell, self.magics.place(1, None))

    def run_line(self, magic_name: str, line: str) -> Any:
        """`%magic_name line` written on a line of the calling cell (tracebacks of code it
        runs point into that line)."""
        return self.magics.run_line(magic_name, line, self.magics.place(1, line))

    def run_cell(self, magic_name: str, line: str, cell: str) -> Any:
        """A `%%magic_name line` cell, the call standing on its first line."""
        return self.magics.run_cell(magic_name, line, cell, self.magics.place(1, ""))

    def help_text(self, target: str, detail_level: int = 0) -> str:
        """What `target?` (`detail_level` 0) or `target??` (1) shows."""
        return self.magics.help_text(target, detail_level, self.namespace_at(1))
