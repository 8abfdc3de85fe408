"""`cloche ports`: the ports listened on in a session, or a preview URL of one."""

from __future__ import annotations

import argparse
import json
from typing import Any

from cloche.commands.common import add_connection_options, client_of, reports_errors


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "ports",
        help="a session's listening ports, or a preview URL of one",
        description="The TCP ports something listens on in a session (a server a command "
        "started there), or, with --preview PORT, a URL that opens that port in a browser "
        "without your token until it expires. With the token, a port is also reached at "
        "{server}/v1/sessions/ID/ports/PORT/. (--url is the server's address, as for every "
        "client command.)",
    )
    parser.add_argument("session", metavar="SESSION", help="the session's id")
    parser.add_argument(
        "--preview", dest="port", type=int, metavar="PORT", help="print a preview URL of PORT"
    )
    parser.add_argument(
        "--ttl", type=int, default=3600, metavar="S", help="the URL's life, 1-86400 s (3600)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    add_connection_options(parser)
    parser.set_defaults(handler=_ports)


@reports_errors("ports")
def _ports(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        ports = client.session(args.session).ports
        if args.port is not None:
            preview = ports.url(args.port, ttl_s=args.ttl)
            if args.json:
                print(
                    json.dumps({"url": preview.url, "expires_at": preview.expires_at.isoformat()})
                )
            else:
                print(preview.url)
            return 0
        found = ports.list()
    if args.json:
        print(json.dumps({"ports": [{"port": port} for port in found]}))
    elif not found:
        print("nothing listens in this session")
    else:
        for port in found:
            print(port)
    return 0
