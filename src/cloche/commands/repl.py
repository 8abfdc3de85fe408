"""`cloche repl`: an interactive Python prompt whose cells run in a cloche session.

Input is gathered as Python's own REPL does (`code.InteractiveConsole`: a statement is sent
when it is complete), with readline editing and history. Ctrl-C during a cell interrupts
it through the API and the session lives on; Ctrl-C at the prompt clears the line.
"""

from __future__ import annotations

import argparse
import code
import contextlib
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from cloche import __version__
from cloche.client.sync import Session
from cloche.commands.common import (
    add_connection_options,
    add_egress_option,
    add_new_session_options,
    ask_person,
    client_of,
    reports_errors,
    show_display,
    show_outcome,
    writer,
)
from cloche.errors import ClocheError, SessionNotFound

HELP = (
    "Type Python as in its own REPL; Ctrl-C interrupts a running cell (the session lives "
    "on); Ctrl-D leaves.\n"
    "%upload LOCAL [REMOTE]   copy a local file into the session's working directory\n"
    "%download REMOTE [LOCAL] copy a file of the session here\n"
    "%session                 print the session's id"
)


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "repl",
        help="an interactive Python prompt in a session",
        description="An interactive Python prompt whose cells run in a session on a cloche "
        "server: a new one, closed when you leave, or --session ID, left open. History is "
        "kept in $CLOCHE_HISTORY (default ~/.cloche_history).\n\n" + HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--session", default=None, metavar="ID", help="use this session")
    parser.add_argument(
        "--profile",
        default="lean",
        help="profile of a new session: lean, data, or the server's own",
    )
    add_egress_option(parser)
    add_new_session_options(parser)
    parser.add_argument("--keep", action="store_true", help="leave a new session open at exit")
    add_connection_options(parser)
    parser.set_defaults(handler=_repl)


class Console(code.InteractiveConsole):
    """Python's interactive console, but a complete statement runs in the session."""

    def __init__(self, session: Session) -> None:
        super().__init__(filename="<cloche>")
        self.session = session

    def push(self, line: str, *args: Any, **kwargs: Any) -> bool:
        if not self.buffer and line.lstrip().startswith("%"):  # never valid Python
            self.magic(line.strip())
            return False
        return bool(super().push(line, *args, **kwargs))

    def runsource(self, source: str, filename: str = "<input>", symbol: str = "single") -> bool:
        """Send the source when it is complete; True asks for another line."""
        try:
            if self.compile(source, filename, symbol) is None:
                return True
        except (OverflowError, SyntaxError, ValueError):
            pass  # complete, but wrong: the session answers with its own SyntaxError
        self.run_cell(source)
        return False

    def run_cell(self, source: str) -> None:
        try:
            execution = self.session.run(
                source,
                on_stdout=writer(sys.stdout),
                on_stderr=writer(sys.stderr),
                on_display=show_display,
                on_input=ask_person,
            )
        except SessionNotFound:
            raise
        except ClocheError as exc:  # the server may come back: stay at the prompt
            print(f"cloche: {exc}", file=sys.stderr, flush=True)
            return
        show_outcome(execution, sys.stdout, sys.stderr)

    def magic(self, line: str) -> None:
        """%upload, %download, %session."""
        try:
            name, *args = shlex.split(line)
        except ValueError as exc:
            print(f"{line}: {exc}", file=sys.stderr)
            return
        try:
            if name == "%upload" and 1 <= len(args) <= 2:
                local = Path(args[0]).expanduser()
                remote = args[1] if len(args) == 2 else local.name
                data = local.read_bytes()
                self.session.upload(remote, data)
                print(f"uploaded {local} to {remote} ({len(data)} bytes)")
            elif name == "%download" and 1 <= len(args) <= 2:
                remote = args[0]
                target = Path(args[1]).expanduser() if len(args) == 2 else Path.cwd()
                if target.is_dir():
                    target = target / PurePosixPath(remote).name
                data = self.session.download(remote)
                target.write_bytes(data)
                print(f"downloaded {remote} to {target} ({len(data)} bytes)")
            elif name == "%session" and not args:
                print(self.session.id)
            else:
                print(f"unknown command: {line}\n{HELP}", file=sys.stderr)
        except (OSError, ClocheError) as exc:
            print(f"{name}: {exc}", file=sys.stderr)


def _history() -> Callable[[], None]:
    """Line editing and history, when readline is there; the function saves the history."""
    try:
        import readline
    except ImportError:  # not on every platform
        return lambda: None
    path = Path(os.environ.get("CLOCHE_HISTORY") or "~/.cloche_history").expanduser()
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(1000)

    def save() -> None:
        with contextlib.suppress(OSError):
            readline.write_history_file(path)

    return save


@reports_errors("repl")
def _repl(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        if args.session:
            session = client.session(args.session)
            owned = False
        else:
            session = client.create_session(
                args.profile, egress=args.egress, template=args.template, env=dict(args.env)
            )
            owned = not args.keep
        save_history = _history()
        left = (
            f"closed session {session.id}"
            if owned
            else f"session {session.id} left open: cloche repl --session {session.id}"
        )
        try:
            Console(session).interact(
                banner=f"cloche {__version__}: session {session.id} ({session.info.profile}) "
                f"on {client.url}\n{HELP}",
                exitmsg=left,
            )
        finally:
            save_history()
            if owned:
                session.close()
    return 0
