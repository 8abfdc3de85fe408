"""`cloche shell SESSION`: a terminal in a session, in this one.

The local terminal goes to raw mode (every key, Ctrl-C and Ctrl-D included, goes to the
remote side), its size follows this window's (SIGWINCH), and it is restored when the shell
ends, the connection drops or anything fails. The exit status is the shell's (128 + N when
signal N ended it). Input that is not a terminal is typed in as it comes, then Ctrl-D.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import termios
import tty
from collections.abc import Iterator
from typing import Any

from cloche.client.aio import AsyncClient
from cloche.client.terminal import AsyncTerminal
from cloche.commands import local_input
from cloche.commands.common import CLOCHE_FAILED, add_connection_options, reports_errors

END_OF_INPUT = b"\x04"  # Ctrl-D: what a terminal's line discipline reads as the input's end


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "shell",
        help="a terminal in a session",
        description="Open a terminal in a session: a login shell of its user (or --cmd), "
        "in raw mode, its size following this window's. Exit status: the shell's (128+N "
        "when signal N ended it), 2 when cloche could not open it or the connection dropped.",
    )
    parser.add_argument("session", metavar="SESSION", help="the session's id")
    parser.add_argument(
        "--cmd", default=None, help="a command line to run in the terminal instead of a shell"
    )
    add_connection_options(parser)
    parser.set_defaults(handler=_shell)


@reports_errors("shell")
def _shell(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


def window_size() -> tuple[int, int]:
    """(cols, rows) of this process's terminal; 80 x 24 without one."""
    for stream in (sys.stdout, sys.stdin, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            size = os.get_terminal_size(stream.fileno())
            return size.columns, size.lines
    return 80, 24


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """fd's terminal in raw mode while the block runs; as it was afterwards, whatever
    happens (nothing to do when fd is not a terminal)."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSADRAIN)  # not TCSAFLUSH: keep what was typed ahead
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _run(args: argparse.Namespace) -> int:
    async with AsyncClient(args.url, args.token, timeout_s=args.request_timeout) as client:
        session = await client.session(args.session)  # SessionNotFound before raw mode
        cols, rows = window_size()
        terminal = await session.pty(cols, rows, args.cmd)
        try:
            with raw_mode(sys.stdin.fileno()):
                await _carry(terminal)
        finally:
            await terminal.close()
    if terminal.exit_code is not None:
        return terminal.exit_code
    if terminal.signal is not None:
        with contextlib.suppress(KeyError):
            return 128 + int(signal.Signals[terminal.signal])
    print("cloche shell: the terminal ended without an exit status", file=sys.stderr)
    return CLOCHE_FAILED


async def _carry(terminal: AsyncTerminal) -> None:
    """The terminal's bytes to stdout, stdin's and the window's size to the terminal,
    until the terminal ends."""
    loop = asyncio.get_running_loop()
    typed = asyncio.create_task(_type(terminal, sys.stdin.fileno()))
    resizing: set[asyncio.Task[None]] = set()

    def resized() -> None:
        cols, rows = window_size()
        task = loop.create_task(terminal.resize(cols, rows))
        resizing.add(task)
        task.add_done_callback(resizing.discard)

    loop.add_signal_handler(signal.SIGWINCH, resized)
    out = sys.stdout.buffer
    try:
        while piece := await terminal.read():
            out.write(piece)
            out.flush()
    finally:
        loop.remove_signal_handler(signal.SIGWINCH)
        typed.cancel()
        await asyncio.gather(typed, return_exceptions=True)


async def _type(terminal: AsyncTerminal, fd: int) -> None:
    """What is typed (or piped) here, to the terminal in order; Ctrl-D after piped input."""
    async for piece in local_input.chunks(fd):
        await terminal.write(piece)
    if not os.isatty(fd):
        await terminal.write(END_OF_INPUT)
