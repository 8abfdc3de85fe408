"""`cloche run FILE|-`: one cell in a fresh session; exit status 1 when the code fails."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cloche.commands.common import (
    CLOCHE_FAILED,
    CODE_FAILED,
    add_connection_options,
    add_egress_option,
    add_new_session_options,
    client_of,
    reports_errors,
    show_display,
    show_outcome,
    writer,
)


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a Python file as one cell in a fresh session",
        description="Run a Python file (or - for stdin) as one cell in a fresh session on a "
        "cloche server, streaming its output; the value of a final expression is printed. "
        "Exit status: 0 ok, 1 the code raised (or timed out), 2 cloche could not run it.",
    )
    parser.add_argument("file", help="the Python file, or - to read stdin")
    parser.add_argument(
        "--profile", default="lean", help="the session's profile: lean, data, or the server's own"
    )
    add_egress_option(parser)
    add_new_session_options(parser)
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="time limit of the cell (at most the server's --cell-timeout)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the session open afterwards and print its id (on stderr)",
    )
    parser.add_argument(
        "--session", default=None, metavar="ID", help="run in this existing session instead"
    )
    add_connection_options(parser)
    parser.set_defaults(handler=_run)


@reports_errors("run")
def _run(args: argparse.Namespace) -> int:
    try:
        code = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        print(f"cloche run: can't read {args.file}: {exc}", file=sys.stderr)
        return CLOCHE_FAILED
    with client_of(args) as client:
        if args.session:
            session = client.session(args.session)
        else:
            session = client.create_session(
                args.profile, egress=args.egress, template=args.template, env=dict(args.env)
            )
        try:
            execution = session.run(
                code,
                timeout=args.timeout,
                on_stdout=writer(sys.stdout),
                on_stderr=writer(sys.stderr),
                on_display=show_display,
            )
        finally:
            if not (args.keep or args.session):
                session.close()
    show_outcome(execution, sys.stdout, sys.stderr)
    if args.keep and not args.session:
        print(f"cloche: kept session {session.id}", file=sys.stderr)
    return 0 if execution.ok else CODE_FAILED
