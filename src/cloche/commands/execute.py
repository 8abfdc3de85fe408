"""`cloche exec SESSION -- CMD ARGS...`: run a command in a session, its output streamed to
this process's own stdout and stderr as it comes, byte for byte, and its exit status passed
through (128 + N when signal N ended it, as a shell says). Input that is not a terminal
(a pipe, a file) is passed to the command's stdin.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

from cloche.client.aio import AsyncClient
from cloche.client.commands import command_body
from cloche.client.process import CommandResult
from cloche.commands import local_input
from cloche.commands.common import (
    CLOCHE_FAILED,
    add_connection_options,
    add_env_option,
    reports_errors,
)

SIGPIPE_STATUS = 128 + signal.SIGPIPE  # this process's stdout was closed: as a shell says


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "exec",
        usage="cloche exec [options] SESSION -- CMD [ARGS ...]",
        help="run a command in a session",
        description="Run a command in a session (one argument: a command line for the "
        "template's shell; several: a program and its arguments, run directly), its output "
        "streamed here as it comes. Input that is not a terminal is passed to its stdin "
        "(echo hi | cloche exec ID -- cat). Exit status: the command's (128+N when signal N "
        "ended it), 2 when cloche could not run it. Ctrl-C kills it.",
    )
    parser.add_argument("session", metavar="SESSION", help="the session's id")
    parser.add_argument(
        "--user", default=None, help="whom it runs as: the session's user, or root (inside)"
    )
    parser.add_argument("--cwd", default=None, help="where it runs (default: the home)")
    add_env_option(parser, "the command")
    parser.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="kill its process group after this long (default: none)",
    )
    parser.add_argument(
        "command", nargs="+", metavar="CMD", help="after --: the command and its arguments"
    )
    add_connection_options(parser)
    parser.set_defaults(handler=_exec)


def exit_status(result: CommandResult) -> int:
    """The status a shell would give for how the command ended."""
    if result.exit_code is not None:
        return result.exit_code
    if result.signal is not None:
        try:
            return 128 + int(signal.Signals[result.signal])
        except KeyError:
            pass
    return CLOCHE_FAILED


@reports_errors("exec")
def _exec(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    cmd, *rest = args.command
    body = command_body(
        cmd,
        args=rest if rest else None,
        cwd=args.cwd,
        env=dict(args.env),
        user=args.user,
        timeout=args.timeout,
    )
    stdin_fd = sys.stdin.fileno() if sys.stdin is not None else -1
    feed = local_input.chunks(stdin_fd) if stdin_fd >= 0 and not os.isatty(stdin_fd) else None
    outputs = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}

    def write(name: str, data: bytes) -> None:
        stream = outputs[name]
        stream.write(data)
        stream.flush()

    async with AsyncClient(args.url, args.token, timeout_s=args.request_timeout) as client:
        session = await client.session(args.session)
        try:
            result = await session.commands.stream(body, on_output=write, stdin=feed)
        except BrokenPipeError:  # our reader left: so does the command (it is killed)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return SIGPIPE_STATUS
    if result.status == "timeout":
        print(f"cloche exec: killed after its time limit of {args.timeout:g} s", file=sys.stderr)
    elif result.exit_code is None and result.signal is None:
        print(f"cloche exec: the command ended: {result.end_reason}", file=sys.stderr)
    return exit_status(result)
