"""`cloche volumes`: the token's volumes (files that outlive sessions): create, list, delete
them; list, put and get their files without a session. `cloche sessions create --volume`
mounts one into a new session."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from cloche.commands.common import (
    add_connection_options,
    add_subcommand_options,
    client_of,
    reports_errors,
)


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "volumes",
        help="create, list or delete volumes; list, put and get their files",
        description="Volumes: directories of yours that outlive sessions, each held to its "
        "size (a write past it fails with ENOSPC inside). A session mounts them when it is "
        "made (`cloche sessions create --volume NAME[:PATH][:ro]`); several may at once.",
    )
    add_connection_options(parser)
    parser.set_defaults(handler=_list, json=False)
    actions = parser.add_subparsers(title="subcommands")
    listing = actions.add_parser("list", help="list the volumes (the default)")
    listing.set_defaults(handler=_list)
    create = actions.add_parser("create", help="make an empty volume")
    create.add_argument("name", metavar="NAME", help="1-64 letters, digits, _, . and -")
    create.add_argument("--size-mib", type=int, required=True, help="its size, MiB")
    create.set_defaults(handler=_create)
    delete = actions.add_parser(
        "delete", help="delete volumes and their files (not while sessions mount them)"
    )
    delete.add_argument("names", nargs="+", metavar="NAME")
    delete.set_defaults(handler=_delete)
    files = actions.add_parser("ls", help="list a volume's files")
    files.add_argument("name", metavar="NAME")
    files.set_defaults(handler=_ls)
    put = actions.add_parser("put", help="copy a local file into a volume")
    put.add_argument("name", metavar="NAME")
    put.add_argument("local", metavar="LOCAL", help="a local file, or - for stdin")
    put.add_argument("remote", metavar="REMOTE", nargs="?", help="its path in the volume")
    put.set_defaults(handler=_put)
    get = actions.add_parser("get", help="copy a file of a volume here")
    get.add_argument("name", metavar="NAME")
    get.add_argument("remote", metavar="REMOTE", help="its path in the volume")
    get.add_argument("local", metavar="LOCAL", nargs="?", help="where to (default: stdout)")
    get.set_defaults(handler=_get)
    add_subcommand_options([listing, create, delete, files, put, get])


def mount_of(text: str) -> dict[str, Any]:
    """--volume NAME[:PATH][:ro] as create_session's {name, path?, read_only}."""
    parts = text.split(":")
    has_mode = len(parts) > 1 and parts[-1] in ("ro", "rw")
    mode = parts.pop() if has_mode else "rw"
    if not parts[0] or len(parts) > 2:
        raise argparse.ArgumentTypeError(f"--volume is NAME[:PATH][:ro], not {text!r}")
    mount: dict[str, Any] = {"name": parts[0], "read_only": mode == "ro"}
    if len(parts) == 2:
        mount["path"] = parts[1]
    return mount


def _mib(size_bytes: int) -> str:
    return f"{size_bytes / (1 << 20):.1f}"


@reports_errors("volumes")
def _list(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        volumes = client.volumes()
    if args.json:
        print(json.dumps([_as_json(v) for v in volumes], indent=2))
        return 0
    print(f"{'NAME':<24}  {'SIZE MiB':>8}  {'USED MiB':>8}  {'SESSIONS':>8}  CREATED")
    for volume in volumes:
        created = volume.created_at.strftime("%Y-%m-%d %H:%M:%S")
        print(
            f"{volume.name:<24}  {volume.size_mib:>8}  {_mib(volume.used_bytes):>8}  "
            f"{len(volume.sessions):>8}  {created}"
        )
    return 0


def _as_json(volume: Any) -> dict[str, Any]:
    fields: dict[str, Any] = dataclasses.asdict(volume)
    fields["created_at"] = volume.created_at.isoformat()
    fields["sessions"] = list(volume.sessions)
    return fields


@reports_errors("volumes create")
def _create(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        volume = client.create_volume(args.name, args.size_mib)
    if args.json:
        print(json.dumps(_as_json(volume), indent=2))
    else:
        print(volume.name)
    return 0


@reports_errors("volumes delete")
def _delete(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        for name in args.names:
            client.delete_volume(name)
            print(f"deleted {name}")
    return 0


@reports_errors("volumes ls")
def _ls(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        files = client.volume_files(args.name)
    if args.json:
        print(json.dumps([dataclasses.asdict(f) for f in files], indent=2))
        return 0
    for file in files:
        print(f"{file.size_bytes:>12}  {file.path}")
    return 0


@reports_errors("volumes put")
def _put(args: argparse.Namespace) -> int:
    if args.local == "-":
        data = sys.stdin.buffer.read()
        remote = args.remote
        if not remote:
            print("cloche volumes put: give REMOTE when reading stdin", file=sys.stderr)
            return 2
    else:
        try:
            data = Path(args.local).read_bytes()
        except OSError as exc:
            print(f"cloche volumes put: {args.local}: {exc.strerror}", file=sys.stderr)
            return 2
        remote = args.remote or Path(args.local).name
    with client_of(args) as client:
        client.upload_to_volume(args.name, remote, data)
    print(f"{args.name}:{remote} ({len(data)} bytes)", file=sys.stderr)
    return 0


@reports_errors("volumes get")
def _get(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        data = client.download_from_volume(args.name, args.remote)
    if args.local in (None, "-"):
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        try:
            Path(args.local).write_bytes(data)
        except OSError as exc:
            print(f"cloche volumes get: {args.local}: {exc.strerror}", file=sys.stderr)
            return 2
    return 0
