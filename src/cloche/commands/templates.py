"""`cloche templates`: a server's templates (a session's system from an image): list, show,
build and delete them. Building and deleting take an admin's token."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from cloche.client.sync import Client
from cloche.commands.common import (
    CODE_FAILED,
    add_connection_options,
    add_subcommand_options,
    client_of,
    reports_errors,
)

WAIT_POLL_S = 1.0


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "templates",
        help="list, show, build or delete templates",
        description="Templates: a session's root filesystem and defaults, built from a "
        "tarball, an image or a Dockerfile. Any token lists and shows them; building and "
        'deleting take an admin\'s token (--admin-token, or role = "admin" in --tokens).',
    )
    add_connection_options(parser)
    parser.set_defaults(handler=_list, json=False)
    actions = parser.add_subparsers(title="subcommands")
    listing = actions.add_parser("list", help="list the templates (the default)")
    listing.set_defaults(handler=_list)
    show = actions.add_parser("show", help="a template's state, progress, and builder's lines")
    show.add_argument("name", metavar="NAME")
    show.set_defaults(handler=_show)
    build = actions.add_parser(
        "build",
        help="build a template",
        description="Build a template NAME from one source. --from-tar and --from-archive "
        "send a local file to the server; --from-image and --dockerfile name things on the "
        "server (its files, its Docker engine).",
    )
    build.add_argument("name", metavar="NAME", help="1-32 of a-z, 0-9, - and _")
    source = build.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--from-tar",
        metavar="FILE",
        help="a root filesystem tarball here (docker export, mmdebstrap), uploaded",
    )
    source.add_argument(
        "--from-archive", metavar="FILE", help="a `docker save` archive here, uploaded"
    )
    source.add_argument(
        "--from-image",
        metavar="REF",
        help="an image on the server: docker-archive:PATH, oci-archive:PATH, oci:DIR[:TAG], "
        "or an image of its Docker engine (docker-daemon:NAME:TAG, or NAME:TAG)",
    )
    source.add_argument(
        "--dockerfile", metavar="FILE", help="a Dockerfile on the server, built by its engine"
    )
    build.add_argument(
        "--context",
        metavar="DIR",
        help="the Dockerfile's context on the server (default: its directory)",
    )
    build.add_argument(
        "--wait", action="store_true", help="wait until it is built; exit 1 if it failed"
    )
    build.set_defaults(handler=_build)
    delete = actions.add_parser("delete", help="delete templates (not while sessions use them)")
    delete.add_argument("names", nargs="+", metavar="NAME")
    delete.set_defaults(handler=_delete)
    add_subcommand_options([listing, show, build, delete])


def _size(size_bytes: int) -> str:
    return f"{size_bytes / (1 << 20):.0f} MiB" if size_bytes else "-"


@reports_errors("templates")
def _list(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        listed = client.templates()
    if args.json:
        print(json.dumps(listed, indent=2))
        return 0
    print(f"{'NAME':<20}  {'STATE':<8}  {'PYTHON':<6}  {'SIZE':>9}  SOURCE")
    for item in listed:
        source = item["source"]
        print(
            f"{item['name']:<20}  {item['state']:<8}  {item['python_version'] or '-':<6}  "
            f"{_size(item['size_bytes']):>9}  {source['kind']}: {source['ref']}"
        )
    return 0


def _describe(template: dict[str, Any]) -> None:
    for key in ("name", "state", "error", "python", "python_version", "shell", "created_at"):
        if template.get(key) is not None:
            print(f"{key + ':':<16}{template[key]}")
    source = template["source"]
    print(f"{'source:':<16}{source['kind']}: {source['ref']}")
    if template.get("user"):
        user = template["user"]
        print(f"{'user:':<16}{user['name']} ({user['uid']}:{user['gid']}), home {user['home']}")
    print(f"{'size:':<16}{_size(template['size_bytes'])}")
    if template.get("progress"):
        print(f"{'progress:':<16}{json.dumps(template['progress'])}")
    for pair in template.get("env", []):
        print(f"{'env:':<16}{pair}")
    if template.get("log") and template["state"] != "ready":
        print("log:")
        for line in template["log"]:
            print(f"  {line}")


@reports_errors("templates show")
def _show(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        template = client.template(args.name)
    if args.json:
        print(json.dumps(template, indent=2))
    else:
        _describe(template)
    return 0


@reports_errors("templates build")
def _build(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        if args.from_tar:
            started = client.build_template(args.name, upload=args.from_tar, kind="tar")
        elif args.from_archive:
            started = client.build_template(args.name, upload=args.from_archive, kind="image")
        else:
            started = client.build_template(
                args.name,
                from_image=args.from_image,
                dockerfile=args.dockerfile,
                context=args.context,
            )
        print(f"building {started['name']}", file=sys.stderr)
        template = _wait(client, args.name) if args.wait else started
    if args.json:
        print(json.dumps(template, indent=2))
    elif args.wait:
        _describe(template)
    return CODE_FAILED if template["state"] == "failed" else 0


def _wait(client: Client, name: str) -> dict[str, Any]:
    """Poll until the template is ready or failed, telling each new phase on stderr."""
    phase = None
    while True:
        template = client.template(name)
        if template["state"] != "building":
            return template
        now = template.get("progress", {}).get("phase")
        if now != phase:
            print(f"{name}: {now}", file=sys.stderr)
            phase = now
        time.sleep(WAIT_POLL_S)


@reports_errors("templates delete")
def _delete(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        for name in args.names:
            client.delete_template(name)
            print(f"deleted {name}")
    return 0
