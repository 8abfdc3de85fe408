"""What the client commands share: connection options, errors, and showing outcomes."""

from __future__ import annotations

import argparse
import functools
import getpass
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from cloche.client.aio import DEFAULT_URL
from cloche.client.execution import Execution, Result
from cloche.client.sync import Client
from cloche.errors import ClocheError

Handler = Callable[[argparse.Namespace], int]
CODE_FAILED = 1  # the user's code raised, or its cell timed out / was interrupted / killed
CLOCHE_FAILED = 2  # cloche could not do it (unreachable, refused, no such session, ...)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        return float(raw) if raw else default
    except ValueError:
        return default


def add_egress_option(parser: argparse.ArgumentParser) -> None:
    """--egress POLICY, for commands that make a session."""
    parser.add_argument(
        "--egress",
        default=None,
        metavar="POLICY",
        help="network for a new session: one of the server's egress policies (default: the "
        "server's default policy, if any; else no network)",
    )


def key_value(text: str) -> tuple[str, str]:
    """KEY=VALUE, as argparse's type of an option (--env, --metadata)."""
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_env_option(parser: argparse.ArgumentParser, what: str) -> None:
    """--env KEY=VALUE, repeatable."""
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        type=key_value,
        metavar="KEY=VALUE",
        help=f"an environment variable of {what} (repeat for more)",
    )


def add_new_session_options(parser: argparse.ArgumentParser) -> None:
    """--template and --env, for commands that make a session."""
    parser.add_argument(
        "--template",
        default=None,
        help="the system of a new session: python (the default), or a template built from "
        "an image (`cloche templates`)",
    )
    add_env_option(parser, "a new session (its cells and commands)")


def add_subcommand_options(actions: Sequence[argparse.ArgumentParser]) -> None:
    """--json and the connection options on each subcommand, keeping what the command
    itself was given (`cloche sessions --json list` and `cloche sessions list --json`)."""
    for action in actions:
        action.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON"
        )
        add_connection_options(action, inherited=True)


def add_connection_options(parser: argparse.ArgumentParser, *, inherited: bool = False) -> None:
    """--url, --token and --request-timeout, each with its CLOCHE_* environment variable.

    With `inherited`, an option left out keeps the value a parent parser gave it.
    """

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if inherited else value

    group = parser.add_argument_group("server")
    group.add_argument(
        "--url",
        default=default(None),
        help=f"the server's HTTP address [env CLOCHE_URL; default {DEFAULT_URL}]",
    )
    group.add_argument(
        "--token",
        default=default(None),
        help="bearer token, for a server started with --token [env CLOCHE_TOKEN]",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=default(_env_float("CLOCHE_REQUEST_TIMEOUT", 60.0)),
        metavar="SECONDS",
        help="how long to wait for the server's answers, cells aside "
        "[env CLOCHE_REQUEST_TIMEOUT; default 60]",
    )


def client_of(args: argparse.Namespace) -> Client:
    """A client for the server the options (or CLOCHE_URL / CLOCHE_TOKEN) name."""
    return Client(args.url, args.token, timeout_s=args.request_timeout)


def reports_errors(name: str) -> Callable[[Handler], Handler]:
    """cloche's exceptions as one line on stderr and exit status 2; Ctrl-C as 130."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        def run(args: argparse.Namespace) -> int:
            try:
                return handler(args)
            except ClocheError as exc:
                print(f"cloche {name}: {exc}", file=sys.stderr)
                return CLOCHE_FAILED
            except KeyboardInterrupt:
                print("KeyboardInterrupt", file=sys.stderr)
                return 130

        return run

    return decorate


def writer(stream: TextIO) -> Callable[[str], None]:
    """A callback that writes streamed output as it comes."""

    def write(text: str) -> None:
        stream.write(text)
        stream.flush()

    return write


def describe(result: Result) -> str:
    """A bundle as a terminal can show it: its text, and a note of any image."""
    text = result.text or ""
    images = ", ".join(f"{kind}, {len(data)} bytes" for kind, data in result.images().items())
    if images:
        return f"{text} [{images}]".strip()
    return text or f"<{', '.join(result.formats)}>"


def ask_person(prompt: str, password: bool) -> str:
    """The answer to a cell's input() or getpass(), from the person at this terminal."""
    if password:
        return getpass.getpass(prompt)
    return input(prompt)


def show_display(result: Result) -> None:
    print(describe(result), flush=True)


def show_outcome(execution: Execution, out: TextIO, err: TextIO) -> None:
    """After streaming: the result's repr, the traceback, and what cloche says about limits."""
    main = execution.result
    if main is not None:
        print(describe(main), file=out, flush=True)
    if execution.error is not None:
        print(execution.error.traceback_text, file=err, flush=True)
    if execution.message:
        print(f"[cloche: {execution.message}]", file=err, flush=True)
