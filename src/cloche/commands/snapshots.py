"""`cloche snapshots`: list a server's snapshots (of your token), or delete some."""

from __future__ import annotations

import argparse
import json
from typing import Any

from cloche.commands.common import (
    add_connection_options,
    add_subcommand_options,
    client_of,
    reports_errors,
)
from cloche.commands.sessions import snapshot_json


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "snapshots",
        help="list or delete snapshots",
        description="The snapshots of your token on a cloche server. Make one with `cloche "
        "sessions snapshot ID`; start a session from one with the SDK's "
        "create_session(snapshot=...) or POST /v1/sessions with a snapshot id.",
    )
    add_connection_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(handler=_list)
    actions = parser.add_subparsers(title="subcommands")
    listing = actions.add_parser("list", help="list snapshots (the default)")
    listing.set_defaults(handler=_list)
    delete = actions.add_parser("delete", help="delete snapshots")
    delete.add_argument("ids", nargs="+", metavar="ID")
    delete.set_defaults(handler=_delete)
    add_subcommand_options([listing, delete])


@reports_errors("snapshots")
def _list(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        listed = client.list_snapshots()
    if args.json:
        print(json.dumps([snapshot_json(s) for s in listed], indent=2))
        return 0
    if not listed:
        print("no snapshots")
        return 0
    print(f"{'ID':<32}  {'SESSION':<32}  {'BYTES':>10}  {'CELLS':>5}  NAME")
    for item in listed:
        print(
            f"{item.id:<32}  {item.session_id:<32}  {item.size_bytes:>10}  "
            f"{item.execution_count:>5}  {item.name}"
        )
    return 0


@reports_errors("snapshots delete")
def _delete(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        for snapshot_id in args.ids:
            client.delete_snapshot(snapshot_id)
            print(f"deleted {snapshot_id}")
    return 0
