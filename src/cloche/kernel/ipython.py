"""IPython cell syntax made Python, line by line, before a cell is compiled.

Agents write IPython: `!ls`, `files = !ls`, `%cd /tmp`, `%%bash`, `df?`. Each such line
becomes one call of the session's shell (`cloche.kernel.shell.Shell`, named `SHELL` in the
cell's globals), on the same line, so tracebacks keep the user's line numbers:

    !ls {path}              ->  __cloche_ipython__.system('ls {path}')
    files = !ls             ->  files = __cloche_ipython__.getoutput('ls')
    !!ls                    ->  __cloche_ipython__.getoutput('ls')
    %cd /tmp                ->  __cloche_ipython__.run_line('cd', '/tmp')
    t = %timeit -o f()      ->  t = __cloche_ipython__.run_line('timeit', '-o f()')
    obj?  obj??  ?obj       ->  __cloche_ipython__.run_line('pinfo', 'obj')  (pinfo2 for ??)
    %pip install x          ->  __cloche_pip__('install x')                  (see `pip.py`)

A cell whose first line is `%%name args` becomes one call on that line, the rest of the
cell its argument (and blank lines). Expansion of `{expr}` and `$name`, and what an unknown
magic does (a UsageError), happen when the call runs, as in IPython.

A cell that is valid Python is never touched. Otherwise a line is translated only where a
statement can start (not inside brackets, a string or a backslash continuation), and only
when it begins with `!`, `%` or `?`, assigns `!`/`%` to a target, or is a dotted name
followed by `?`/`??`: `a != b`, `a % b`, `"%d" % n` and `{'!': 1}` are left alone.
"""

from __future__ import annotations

import ast
import re
import types
from typing import Any, NamedTuple

from .pip import transform as pip_transform

SHELL = "__cloche_ipython__"  # the shell's name in a cell's globals

_MAYBE = re.compile(r"[!%?]")
_CELL_MAGIC = re.compile(r"^[ \t]*%%(?P<name>\S*)[ \t]*(?P<line>.*?)[ \t\r]*$")
_LINE_MAGIC = re.compile(r"^%(?P<name>\S*)[ \t]*(?P<line>.*?)[ \t\r]*$")
_ASSIGN = re.compile(r"^(?P<target>[^=!%]+?)[ \t]*=[ \t]*(?P<escape>[!%])(?P<rest>.*)$")
_DOTTED = r"%{0,2}[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_HELP_AFTER = re.compile(rf"^(?P<target>{_DOTTED})[ \t]*(?P<marks>\?\??)[ \t\r]*$")
_HELP_BEFORE = re.compile(rf"^(?P<marks>\?\??)[ \t]*(?P<target>(?:{_DOTTED})?)[ \t\r]*$")


class Compiled(NamedTuple):
    """A cell made code: its statements, and its last expression when it ends on one."""

    body: types.CodeType
    tail: types.CodeType | None
    translated: bool  # the cell held IPython syntax


def compile_cell(
    source: str,
    filename: str,
    *,
    ipython: bool = True,
    first_line: int = 1,
    column: int = 0,
) -> Compiled:
    """Translate a cell (only its `%pip` lines unless `ipython`) and compile it.

    `first_line` and `column` place the source inside a larger one (the body of `%%time`,
    the statement of `%time`), so that tracebacks point into the cell as written.

    Raises:
        SyntaxError: with the line as written, not as translated.
    """
    runnable = translate(source) if ipython else pip_transform(source)
    try:
        tree = ast.parse(runnable, filename=filename, mode="exec")
    except SyntaxError as exc:
        _place_syntax_error(exc, source, runnable, first_line)
        raise
    if first_line != 1 or column:
        _move(tree, first_line - 1, column)
    last: ast.Expression | None = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        del tree.body[-1]
    body = compile(tree, filename, "exec", dont_inherit=True)
    tail = compile(last, filename, "eval", dont_inherit=True) if last else None
    return Compiled(body, tail, runnable is not source)


def translate(source: str) -> str:
    """The cell as Python, one line out for each line in (the same object if unchanged)."""
    if not _MAYBE.search(source):
        return source
    try:
        ast.parse(source)
    except SyntaxError:
        pass
    except Exception:  # null bytes, too deep: the compiler says so, in the user's terms
        return source
    else:
        return source
    lines = source.split("\n")
    cell = _cell_magic(lines)
    if cell is not None:
        return "\n".join(cell)
    out: list[str] = []
    scanner = _Scanner()
    number = 0
    while number < len(lines):
        line = lines[number]
        if scanner.at_statement_start():
            joined, count = _join_continued(lines, number)
            translated = _translate_line(joined)
            if translated is not None:
                out.append(translated)
                out.extend([""] * (count - 1))  # continuation lines: blank, numbers kept
                number += count
                continue
        scanner.feed(line)
        out.append(line)
        number += 1
    translated_source = "\n".join(out)
    return source if translated_source == source else translated_source


def _cell_magic(lines: list[str]) -> list[str] | None:
    """`%%name line` on the first non-blank line: the whole cell as one call."""
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        match = _CELL_MAGIC.match(line)
        if match is None or _HELP_AFTER.match(line.strip()):  # `%%bash?` asks for help
            return None
        body = "\n".join(lines[number + 1 :])
        if body and not body.endswith("\n"):
            body += "\n"  # as IPython passes it: the cell ends with a newline
        call = f"{SHELL}.run_cell({match['name']!r}, {match['line']!r}, {body!r})"
        return [*lines[:number], call, *[""] * (len(lines) - number - 1)]
    return None


def _join_continued(lines: list[str], number: int) -> tuple[str, int]:
    """An escaped line with the lines its trailing backslashes continue it with, joined by
    spaces as IPython does; and how many lines that took."""
    line = lines[number].rstrip("\r")
    stripped = line.lstrip()
    if not stripped.startswith(("!", "%")) and _ASSIGN.match(stripped) is None:
        return line, 1
    count = 1
    while line.endswith("\\") and number + count < len(lines):
        line = line[:-1].rstrip() + " " + lines[number + count].rstrip("\r").strip()
        count += 1
    return line, count


def _translate_line(line: str) -> str | None:
    """The call a line of IPython syntax stands for, or None for a line of Python."""
    body = line.lstrip(" \t")
    indent = line[: len(line) - len(body)]
    if not body:
        return None
    help_match = _HELP_AFTER.match(body) or _HELP_BEFORE.match(body)
    if help_match is not None:
        return indent + _help(help_match["target"], help_match["marks"])
    if body[0] in "!%":
        pip = pip_transform(line)
        if pip != line:
            return pip
        return indent + _escaped(body)
    assign = _ASSIGN.match(body)
    if assign is not None and _is_target(assign["target"]):
        escaped = assign["escape"] + assign["rest"]
        pip = pip_transform(escaped)
        if pip != escaped:
            value = pip
        else:
            value = _escaped(escaped, output=True)  # `x = !cmd`: the output's lines
        return f"{indent}{assign['target']} = {value}"
    return None


def _escaped(body: str, *, output: bool = False) -> str:
    """`!cmd`, `!!cmd` or `%magic line` (without indentation) as an expression; with
    `output`, `!cmd` as `!!cmd`: the command's output."""
    if body.startswith("!!") or (body.startswith("!") and output):
        return f"{SHELL}.getoutput({body.lstrip('!').strip()!r})"
    if body.startswith("!"):
        return f"{SHELL}.system({body[1:].strip()!r})"
    match = _LINE_MAGIC.match(body)
    assert match is not None  # the pattern matches any line starting with `%`
    return f"{SHELL}.run_line({match['name']!r}, {match['line']!r})"


def _help(target: str, marks: str) -> str:
    magic = "pinfo2" if marks == "??" else "pinfo"
    return f"{SHELL}.run_line({magic!r}, {target!r})"


def _is_target(text: str) -> bool:
    """Whether `text = value` is an assignment (`x`, `a, b`, `self.x`, `d[k]`)."""
    try:
        tree = ast.parse(f"{text} = None")
    except SyntaxError:
        return False
    return len(tree.body) == 1 and isinstance(tree.body[0], ast.Assign)


class _Scanner:
    """Follows brackets, strings and backslash continuations over lines of Python, to
    know where a statement can start."""

    def __init__(self) -> None:
        self.depth = 0  # open brackets
        self.quote: str | None = None  # the delimiter of the string still open
        self.continued = False  # the last line ended with a backslash

    def at_statement_start(self) -> bool:
        return self.depth == 0 and self.quote is None and not self.continued

    def feed(self, line: str) -> None:
        line = line.rstrip("\r")
        self.continued = False
        index, end = 0, len(line)
        while index < end:
            char = line[index]
            if self.quote is not None:
                if char == "\\":
                    index += 2
                    if index > end:  # a backslash ends the line: the string goes on
                        return
                elif line.startswith(self.quote, index):
                    index += len(self.quote)
                    self.quote = None
                else:
                    index += 1
                continue
            if char == "#":
                break
            if char in "([{":
                self.depth += 1
            elif char in ")]}":
                self.depth = max(0, self.depth - 1)
            elif char in "'\"":
                triple = line[index : index + 3]
                self.quote = triple if triple in ('"""', "'''") else char
                index += len(self.quote)
                continue
            elif char == "\\" and index == end - 1:
                self.continued = True
            index += 1
        if self.quote is not None and len(self.quote) == 1:
            self.quote = None  # a one-quote string can't span lines: the compiler says so


def _move(tree: ast.Module, lines: int, column: int) -> None:
    """Shift a parsed fragment to where it stands in the cell (columns of its first line
    only: the fragment of a line magic is one line)."""
    for found in ast.walk(tree):
        if not hasattr(found, "lineno"):
            continue
        node: Any = found  # an expression, statement, argument... (all with positions)
        if column and node.lineno == 1:
            node.col_offset += column
            if getattr(node, "end_lineno", None) == 1 and node.end_col_offset is not None:
                node.end_col_offset += column
        node.lineno += lines
        if getattr(node, "end_lineno", None) is not None:
            node.end_lineno += lines


def _place_syntax_error(exc: SyntaxError, source: str, runnable: str, first_line: int) -> None:
    """Show the line as written (not its translation), where it stands in the cell."""
    if exc.lineno is None:
        return
    written = source.split("\n")
    translated = runnable.split("\n")
    number = exc.lineno - 1
    if 0 <= number < len(written) and number < len(translated):
        if written[number] != translated[number]:
            exc.text = written[number]
            exc.offset = exc.end_offset = None
    exc.lineno += first_line - 1
    if exc.end_lineno is not None:
        exc.end_lineno += first_line - 1
