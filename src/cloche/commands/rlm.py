"""`cloche rlm "question" --context FILE`: answer with a Recursive Language Model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cloche.client.verbs import RLM_TIMEOUT_S
from cloche.commands.common import add_connection_options, client_of, reports_errors


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "rlm",
        help="answer a question about a (large) context with a Recursive Language Model",
        description="Answer a question with a Recursive Language Model on a cloche server "
        "started with --llm-base-url and --llm-model: the context is streamed into a session "
        "as the variable `context`, and the server's root model answers by running code in "
        "it that calls sub-models on pieces of it. Exit status: 0 answered, 2 cloche (or the "
        "model's endpoint) could not.",
    )
    parser.add_argument("question", help="what to ask about the context")
    parser.add_argument(
        "--context",
        default=None,
        metavar="FILE",
        help="the context: a file (JSON when it ends in .json), or - to read stdin",
    )
    parser.add_argument(
        "--model", default=None, help="model of the root and of llm_query (default: the server's)"
    )
    parser.add_argument(
        "--session", default=None, metavar="ID", help="ask in this existing session instead"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the session afterwards and print its id"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=RLM_TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long to wait for the answer (default {RLM_TIMEOUT_S:g})",
    )
    add_connection_options(parser)
    parser.set_defaults(handler=_rlm)


@reports_errors("rlm")
def _rlm(args: argparse.Namespace) -> int:
    context: Any = None
    if args.context == "-":
        context = sys.stdin.read()
    elif args.context is not None:
        context = Path(args.context)
        if not context.is_file():
            print(f"cloche rlm: no such file: {args.context}", file=sys.stderr)
            return 2
    with client_of(args) as client:
        session = client.session(args.session) if args.session else client.create_session()
        try:
            answer = session.rlm(
                args.question, context=context, model=args.model, timeout_s=args.timeout
            )
        finally:
            if not (args.keep or args.session):
                session.close()
    print(answer)
    if args.keep and not args.session:
        print(f"cloche: kept session {session.id}", file=sys.stderr)
    return 0
