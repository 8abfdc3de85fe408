"""The processes of a cell's shell commands: a group of their own, streamed, reaped.

A command runs as `/bin/sh -c CMD` (or the program a cell magic names) in the sandbox, in
the current directory, as the session's user and under its limits. Its output is written
to `sys.stdout`/`sys.stderr` as it arrives (so the cell streams it), or captured; an
interrupt of the cell kills the command's process group and raises KeyboardInterrupt.
"""

from __future__ import annotations

import codecs
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import selectors
    import subprocess

SH = "/bin/sh"
_CHUNK = 1 << 16
# How often a silent command is checked for having exited while something it started in
# the background still holds its output pipes (`!sleep 100 &`): then the cell goes on.
_EXIT_CHECK_S = 0.1


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
