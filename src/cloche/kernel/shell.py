"""What `get_ipython()` returns in a cell: the part of IPython's shell the kernel offers.

Shell commands (`!cmd`, `x = !cmd`, `%%bash`) run as `/bin/sh -c CMD` in the sandbox, in
the current directory, as the session's user and under its limits. Their output is
written to `sys.stdout`/`sys.stderr` as it arrives (so the cell streams it); interrupting
the cell kills the command's process group and raises KeyboardInterrupt.

`{expr}` and `$name` in a command are expanded as IPython does (`var_expand`): `{expr}` is
evaluated in the cell's namespace, `$name` (and `$name.attr`) is replaced when the name is
a variable there, `$$name` is a literal `$name`, and anything else (`$HOME`, `$((1+1))`,
`{}` of `find -exec`, an expression that fails) is passed to the shell unchanged. Unlike
IPython, a piece that can't be expanded leaves only itself as written, not the whole line.
"""

from __future__ import annotations

import builtins
import codecs
import os
import re
import signal
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from .ipython import SHELL

if TYPE_CHECKING:
    import selectors
    import subprocess

    from .magics import Magics

SH = "/bin/sh"
_CHUNK = 1 << 16
# How often a silent command is checked for having exited while something it started in
# the background still holds its output pipes (`!sleep 100 &`): then the cell goes on.
_EXIT_CHECK_S = 0.1
_DOLLAR = re.compile(
    r"\$(\$[\w.]+|[A-Za-z_]\w*(?:\.\w+)*)"
    r"(?=(?:[^']*'[^']*')*[^']*$)"  # not inside single quotes (an even number follow)
)
_CONVERSIONS: dict[str, Callable[[Any], str]] = {"r": repr, "s": str, "a": ascii}


class UsageError(Exception):
    """A line of IPython syntax the kernel does not offer (an unknown magic), or a magic
    given arguments it does not take. The message names what is available."""


UsageError.__module__ = "builtins"  # shown as `UsageError: ...`, as IPython shows it


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


class Shell:
    """The session's shell: runs commands and magics for the cell's IPython syntax.

    Args:
        user_ns: the session's namespace (`get_ipython().user_ns`).
        history: the session's cells so far, for `%history`.
    """

    def __init__(self, user_ns: dict[str, Any], history: History) -> None:
        self.user_ns = user_ns
        self.history = history
        # Where `obj?` sends its text: a Jupyter client's pager (IPython's `page` payload)
        # when the cell's client has one, else None and the text is printed.
        self.pager: Callable[[str], None] | None = None
        self._magics: Magics | None = None
        self.install(user_ns)

    @property
    def magics(self) -> Magics:
        """The magics, loaded on first use (the kernel starts without them)."""
        if self._magics is None:
            from .magics import Magics

            self._magics = Magics(self)
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


def expand(command: str, namespace: Mapping[str, Any]) -> str:
    """`{expr}` and `$name` of a shell command expanded (see the module's docstring)."""
    import string  # here: the kernel starts without it

    try:
        pieces = list(string.Formatter().parse(command))
    except ValueError:  # a lone `}` or `{`: braces are the shell's
        return _expand_names(command, namespace)
    out: list[str] = []
    for literal, field, spec, conversion in pieces:
        out.append(_expand_names(literal, namespace))
        if field is not None:
            out.append(_expand_field(field, spec or "", conversion, namespace))
    return "".join(out)


def _expand_field(field: str, spec: str, conversion: str | None, ns: Mapping[str, Any]) -> str:
    # As IPython's FullEvalFormatter: `{x[1:3]}` is parsed as field `x[1` and spec `3]`.
    expression = f"{field}:{spec}" if spec else field
    try:
        value = eval(expression, dict(ns))  # noqa: S307  # the user's own expression
        if conversion:
            value = _CONVERSIONS[conversion](value)
        return format(value, "")
    except Exception:
        shown = f"!{conversion}" if conversion else ""
        return "{" + field + shown + (f":{spec}" if spec else "") + "}"


def _expand_names(text: str, namespace: Mapping[str, Any]) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match[1]
        if name.startswith("$"):
            return name  # `$$name` is `$name`, for the shell
        parts = name.split(".")
        if parts[0] not in namespace:
            return match[0]
        value = namespace[parts[0]]
        used = 1
        for attribute in parts[1:]:
            try:
                value = getattr(value, attribute)
            except Exception:
                break
            used += 1
        try:
            shown = format(value, "")
        except Exception:
            return match[0]
        return shown + "".join("." + part for part in parts[used:])

    return _DOLLAR.sub(replace, text)


def run_command(argv: list[str], *, capture: bool) -> tuple[int, str]:
    """Run a command in a process group of its own; return its exit code, and its output
    (stdout and stderr together) when `capture`, else stream that to sys.stdout/stderr.

    Raises:
        KeyboardInterrupt: the cell was interrupted; the command's group was killed.
    """
    import subprocess  # here: the kernel starts without it

    process = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if capture else subprocess.PIPE,
        start_new_session=True,
    )
    _reaper.started(process.pid)
    try:
        output = _pump(process, capture)
        return process.wait(), output
    except BaseException:
        _kill(process)
        raise
    finally:
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
        _reaper.ended(process.pid)


def _pump(process: subprocess.Popen[bytes], capture: bool) -> str:
    """Read the command's pipes until they close, or until it has exited and only
    something it left in the background holds them."""
    import selectors

    captured: list[str] = []
    writers: dict[int, tuple[Callable[[str], None], codecs.IncrementalDecoder]] = {}
    for pipe, name in ((process.stdout, "stdout"), (process.stderr, "stderr")):
        if pipe is not None:
            write = captured.append if capture else _writer(name)
            writers[pipe.fileno()] = (write, codecs.getincrementaldecoder("utf-8")("replace"))
    with selectors.DefaultSelector() as selector:
        for fd in writers:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            ready = selector.select(_EXIT_CHECK_S)
            if not ready and process.poll() is not None:
                for key in list(selector.get_map().values()):
                    _read(key.fd, writers[key.fd], selector)
                break
            for key, _ in ready:
                _read(key.fd, writers[key.fd], selector)
    for write, decoder in writers.values():
        rest = decoder.decode(b"", final=True)
        if rest:
            write(rest)
    return "".join(captured)


def _read(
    fd: int,
    writer: tuple[Callable[[str], None], codecs.IncrementalDecoder],
    selector: selectors.BaseSelector,
) -> None:
    """Forward what the pipe holds; unregister it once it is closed."""
    write, decoder = writer
    while True:
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        if not data:
            selector.unregister(fd)
            return
        text = decoder.decode(data)
        if text:
            write(text)
        if len(data) < _CHUNK:
            return


def _writer(name: str) -> Callable[[str], None]:
    def write(text: str) -> None:
        stream = getattr(sys, name)  # looked up each time: the cell may redirect it
        stream.write(text)
        stream.flush()

    return write


class _Reaper:
    """Reaps what commands left behind.

    The kernel is pid 1 of its sandbox: a process a command started in the background (or
    whose parent was killed with the command) is the kernel's once its parent is gone, and
    would stay a zombie, holding one of the session's pids, since nothing else waits for it.
    Each command runs in a session of its own, so the zombies of those sessions are
    reaped, after each command; never another child of the kernel (a `subprocess.Popen` of
    the user's own would lose its exit status).
    """

    def __init__(self) -> None:
        self._sessions: set[int] = set()  # of commands, while something of theirs lives
        self._running: set[int] = set()  # commands not yet waited for (threads may run some)

    def started(self, pid: int) -> None:
        self._sessions.add(pid)
        self._running.add(pid)

    def ended(self, pid: int) -> None:
        self._running.discard(pid)
        me = os.getpid()
        living: set[int] = set()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as stat:
                    fields = stat.read().rpartition(")")[2].split()
                state, parent, session = fields[0], int(fields[1]), int(fields[3])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            if session not in self._sessions:
                continue
            if state == "Z" and parent == me and int(name) not in self._running:
                try:
                    os.waitpid(int(name), os.WNOHANG)
                except ChildProcessError:
                    pass
            else:
                living.add(session)
        self._sessions &= living | self._running


_reaper = _Reaper()  # of the process: its children are the kernel's, whichever shell ran them


def _kill(process: subprocess.Popen[bytes]) -> None:
    """Kill the command's process group (what it started too), and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        process.kill()
    try:
        process.wait()
    except BaseException:  # noqa: S110  # a second interrupt: the kernel reaps it later
        pass
