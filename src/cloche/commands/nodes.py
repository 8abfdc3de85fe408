"""`cloche nodes`: a cluster-mode server's nodes (an admin's token): list them, drain one,
return one to service, and `leave`, a node's pod's preStop hook that drains its own node."""

from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Any

from cloche.commands.common import (
    add_connection_options,
    add_subcommand_options,
    client_of,
    reports_errors,
)


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "nodes",
        help="a cluster's nodes: list, drain, resume, leave (an admin's token)",
        description="The nodes of a server started with --cluster. These take an admin's "
        'token (--admin-token, or role = "admin" in --tokens).',
    )
    add_connection_options(parser)
    parser.set_defaults(handler=_list, json=False)
    actions = parser.add_subparsers(title="subcommands")
    listing = actions.add_parser("list", help="list the nodes (the default)")
    listing.set_defaults(handler=_list)
    drain = actions.add_parser(
        "drain", help="move a node's sessions and snapshots to the other nodes"
    )
    drain.add_argument("node", metavar="NODE", help="its id, or its address")
    drain.set_defaults(handler=_drain)
    resume = actions.add_parser("resume", help="return a draining node to service")
    resume.add_argument("node", metavar="NODE")
    resume.set_defaults(handler=_resume)
    leave = actions.add_parser(
        "leave",
        help="drain this machine's node (a Kubernetes preStop hook)",
        description="Drain the node at this machine's address (--address, else $POD_IP, else "
        "the host's own address) before its pod goes, then print the report. What could "
        "not be moved within the grace is reported, and lost when the node stops.",
    )
    leave.add_argument("--address", default=None, help="the node's address [env POD_IP]")
    leave.set_defaults(handler=_leave)
    for action in (drain, leave):
        action.add_argument(
            "--grace",
            type=float,
            default=None,
            metavar="SECONDS",
            help="move sessions for this long at most (default: the server's --node-grace)",
        )
    add_subcommand_options([listing, drain, resume, leave])


@reports_errors("nodes")
def _list(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        view = client.cluster()
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    print(f"{'ID':<24}  {'STATE':<9}  {'ADDRESS':<21}  {'SESSIONS':>8}  {'PAUSED':>6}")
    for node in view.get("nodes", []):
        address = str(node.get("address", ""))
        print(
            f"{node['id']:<24}  {node['state']:<9}  {address:<21}  "
            f"{node.get('sessions', 0):>8}  {node.get('paused', 0):>6}"
        )
    return 0


@reports_errors("nodes drain")
def _drain(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        report = client.drain_node(args.node, args.grace)
    return _show(args, report)


@reports_errors("nodes resume")
def _resume(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        answer = client.resume_node(args.node)
    print(json.dumps(answer) if args.json else f"node {answer['node']}: {answer['state']}")
    return 0


@reports_errors("nodes leave")
def _leave(args: argparse.Namespace) -> int:
    address = args.address or os.environ.get("POD_IP") or _own_address()
    with client_of(args) as client:
        report = client.drain_node(address, args.grace)
    return _show(args, report)


def _show(args: argparse.Namespace, report: dict[str, Any]) -> int:
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"node {report['node']}: {report['moved']} sessions moved, "
        f"{len(report['failed'])} not, {report['snapshots']} snapshots copied"
    )
    for session_id, why in report.get("why", {}).items():
        print(f"  {session_id}: {why}")
    return 0


def _own_address() -> str:
    """This host's address by its name (a pod's own IP; $POD_IP is surer)."""
    return socket.gethostbyname(socket.gethostname())
