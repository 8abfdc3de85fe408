"""`cloche sessions`: list the sessions on a server, show one, close some."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from cloche.client.aio import SessionInfo, SnapshotInfo
from cloche.commands.common import add_connection_options, client_of, reports_errors


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sessions",
        help="list, show or close sessions",
        description="The sessions of your token on a cloche server (all of them, on a server "
        "without tokens). Without a subcommand: list.",
    )
    add_connection_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(handler=_list)
    actions = parser.add_subparsers(title="subcommands")
    listing = actions.add_parser("list", help="list sessions (the default)")
    listing.set_defaults(handler=_list)
    show = actions.add_parser("show", help="what the server says about one session")
    show.add_argument("id")
    show.set_defaults(handler=_show)
    close = actions.add_parser("close", help="close sessions")
    close.add_argument("ids", nargs="+", metavar="ID")
    close.set_defaults(handler=_close)
    snapshot = actions.add_parser("snapshot", help="save a session as it is now")
    snapshot.add_argument("id")
    snapshot.add_argument("--name", default="", help="a name of your choosing")
    snapshot.set_defaults(handler=_snapshot)
    fork = actions.add_parser("fork", help="copy a session into new, independent ones")
    fork.add_argument("id")
    fork.add_argument("-n", "--count", type=int, default=1, help="copies to make")
    fork.set_defaults(handler=_fork)
    pause = actions.add_parser("pause", help="save sessions to disk and free their memory")
    pause.add_argument("ids", nargs="+", metavar="ID")
    pause.set_defaults(handler=_pause)
    resume = actions.add_parser("resume", help="bring paused sessions back now")
    resume.add_argument("ids", nargs="+", metavar="ID")
    resume.set_defaults(handler=_resume)
    for action in (listing, show, close, snapshot, fork, pause, resume):
        action.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON"
        )
        add_connection_options(action, inherited=True)


def _as_json(info: SessionInfo) -> dict[str, Any]:
    fields = dataclasses.asdict(info)
    fields["created_at"] = info.created_at.isoformat()
    fields["expires_at"] = info.expires_at.isoformat()
    return fields


@reports_errors("sessions")
def _list(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        listed = client.list_sessions()
    if args.json:
        print(json.dumps([_as_json(info) for info in listed], indent=2))
        return 0
    if not listed:
        print("no sessions")
        return 0
    print(f"{'ID':<32}  {'PROFILE':<7}  {'STATE':<8}  {'CELLS':>5}  CREATED (UTC)")
    for info in listed:
        created = info.created_at.strftime("%Y-%m-%d %H:%M:%S")
        print(
            f"{info.id:<32}  {info.profile:<7}  {info.state:<8}  "
            f"{info.execution_count:>5}  {created}"
        )
    return 0


@reports_errors("sessions show")
def _show(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        info = client.get_session(args.id)
    if args.json:
        print(json.dumps(_as_json(info), indent=2))
        return 0
    print(f"id         {info.id}")
    print(f"profile    {info.profile}")
    print(f"state      {info.state}")
    print(f"cells      {info.execution_count}")
    print(f"created    {info.created_at.isoformat()}")
    print(f"expires    {info.expires_at.isoformat()} (if left idle)")
    for name, value in info.limits.items():
        print(f"{name:<10} {value:g}")
    return 0


@reports_errors("sessions close")
def _close(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        for session_id in args.ids:
            client.close_session(session_id)
            print(f"closed {session_id}")
    return 0


@reports_errors("sessions snapshot")
def _snapshot(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        made = client.session(args.id).snapshot(args.name)
    if args.json:
        print(json.dumps(snapshot_json(made), indent=2))
    else:
        print(f"snapshot {made.id} of {made.session_id} ({made.size_bytes} bytes)")
    return 0


@reports_errors("sessions fork")
def _fork(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        copies = client.session(args.id).fork(args.count)
    if args.json:
        print(json.dumps([_as_json(copy.info) for copy in copies], indent=2))
    else:
        for copy in copies:
            print(copy.id)
    return 0


def _each(verb: str, done: str) -> Callable[[argparse.Namespace], int]:
    """A command that calls Session.<verb>() on each id given."""

    @reports_errors(f"sessions {verb}")
    def command(args: argparse.Namespace) -> int:
        with client_of(args) as client:
            for session_id in args.ids:
                getattr(client.session(session_id), verb)()
                print(f"{done} {session_id}")
        return 0

    return command


_pause = _each("pause", "paused")
_resume = _each("resume", "resumed")


def snapshot_json(info: SnapshotInfo) -> dict[str, Any]:
    fields = dataclasses.asdict(info)
    fields["created_at"] = info.created_at.isoformat()
    return fields
