"""`cloche sessions`: list the sessions on a server (by state, profile or metadata), make
one, show one, its cell history, label, close, snapshot, fork, pause and resume them."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from cloche.client.execution import Cell
from cloche.client.info import SessionInfo, SnapshotInfo
from cloche.commands.common import (
    add_connection_options,
    add_egress_option,
    add_new_session_options,
    add_subcommand_options,
    client_of,
    describe,
    reports_errors,
)
from cloche.commands.volumes import mount_of

SNIPPET_CHARS = 72  # of a cell's code or output, in `sessions history`


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sessions",
        help="list, make, show, label or close sessions; a session's cell history",
        description="The sessions of your token on a cloche server (all of them, on a server "
        "without tokens). Without a subcommand: list. Metadata are labels of your choosing "
        "(KEY=VALUE strings) that a session keeps: set them with `create --metadata` or "
        "`label`, find sessions by them with `list --filter`.",
    )
    add_connection_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")
    _add_filters(parser)
    parser.set_defaults(handler=_list)
    actions = parser.add_subparsers(title="subcommands")
    listing = actions.add_parser(
        "list", help="list sessions (the default), with their metadata; filter them"
    )
    _add_filters(listing, inherited=True)
    listing.set_defaults(handler=_list)
    create = actions.add_parser("create", help="make a session and print its id")
    create.add_argument("--profile", default="lean", help="lean, data, or one of the server's")
    create.add_argument(
        "--metadata",
        action="append",
        type=_pair,
        default=[],
        metavar="KEY=VALUE",
        help="a label to give it (repeat for more)",
    )
    create.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS", help="its cells' time limit"
    )
    add_egress_option(create)
    add_new_session_options(create)
    create.add_argument(
        "--volume",
        action="append",
        default=[],
        type=mount_of,
        metavar="NAME[:PATH][:ro]",
        help="mount a volume of yours (at /mnt/NAME unless PATH; read-only with :ro); repeat",
    )
    create.set_defaults(handler=_create)
    show = actions.add_parser("show", help="what the server says about one session")
    show.add_argument("id")
    show.set_defaults(handler=_show)
    history = actions.add_parser(
        "history",
        help="the cells a session ran, oldest first",
        description="The cells a session ran, as its history keeps them (the server's last "
        "--history-cells of each session, outputs cut to --history-output-bytes): per "
        "cell, its number, why it ended, how long it took, which front end sent it, the "
        "first line of its code, and the first lines of its output. --json: every field.",
    )
    history.add_argument("id")
    history.add_argument(
        "--after", type=int, default=0, metavar="N", help="only cells numbered above N"
    )
    history.add_argument("--limit", type=int, default=None, metavar="N", help="at most N cells")
    history.set_defaults(handler=_history)
    label = actions.add_parser(
        "label",
        help="set or delete a session's metadata (KEY=VALUE; KEY= deletes KEY)",
        description="Merge labels into a session's metadata: KEY=VALUE sets KEY, KEY= (no "
        "value) deletes it; the others are kept. Prints the metadata it then has.",
    )
    label.add_argument("id")
    label.add_argument("pairs", nargs="+", type=_pair, metavar="KEY=VALUE")
    label.set_defaults(handler=_label)
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
    add_subcommand_options(
        [listing, create, show, history, label, close, snapshot, fork, pause, resume]
    )


def _pair(text: str) -> tuple[str, str]:
    """KEY=VALUE, as argparse's type of a metadata option."""
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _add_filters(parser: argparse.ArgumentParser, *, inherited: bool = False) -> None:
    """--state, --profile and --filter KEY=VALUE, for listing."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if inherited else value

    group = parser.add_argument_group("filters")
    group.add_argument(
        "--state", default=default(None), help="only sessions in this state: idle, busy, paused"
    )
    group.add_argument("--profile", default=default(None), help="only sessions of this profile")
    group.add_argument(
        "--filter",
        dest="filters",
        action="append",
        type=_pair,
        default=default([]),
        metavar="KEY=VALUE",
        help="only sessions whose metadata has KEY=VALUE (repeat: all of them)",
    )


def _as_json(info: SessionInfo) -> dict[str, Any]:
    fields = dataclasses.asdict(info)
    fields["created_at"] = info.created_at.isoformat()
    fields["expires_at"] = info.expires_at.isoformat()
    return fields


def _labels(metadata: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in metadata.items())


@reports_errors("sessions")
def _list(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        listed = client.list_sessions(
            state=args.state, profile=args.profile, metadata=dict(args.filters)
        )
    if args.json:
        print(json.dumps([_as_json(info) for info in listed], indent=2))
        return 0
    if not listed:
        print("no sessions")
        return 0
    print(
        f"{'ID':<36}  {'PROFILE':<7}  {'TEMPLATE':<8}  {'STATE':<8}  {'CELLS':>5}  "
        f"{'CREATED (UTC)':<19}  METADATA"
    )
    for info in listed:
        created = info.created_at.strftime("%Y-%m-%d %H:%M:%S")
        print(
            f"{info.id:<36}  {info.profile:<7}  {info.template:<8}  {info.state:<8}  "
            f"{info.execution_count:>5}  {created:<19}  {_labels(info.metadata)}".rstrip()
        )
    return 0


@reports_errors("sessions create")
def _create(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        made = client.create_session(
            args.profile,
            timeout=args.timeout,
            egress=args.egress,
            metadata=dict(args.metadata),
            template=args.template,
            env=dict(args.env),
            volumes=args.volume,
        )
    if args.json:
        print(json.dumps(_as_json(made.info), indent=2))
    else:
        print(made.id)
    return 0


@reports_errors("sessions label")
def _label(args: argparse.Namespace) -> int:
    changes: dict[str, str | None] = {key: value or None for key, value in args.pairs}
    with client_of(args) as client:
        info = client.session(args.id).update_metadata(changes)
    if args.json:
        print(json.dumps(info.metadata, indent=2))
    else:
        for key, value in info.metadata.items():
            print(f"{key}={value}")
    return 0


@reports_errors("sessions history")
def _history(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        cells = client.session(args.id).history(args.after, args.limit)
    if args.json:
        print(json.dumps([_cell_json(cell) for cell in cells], indent=2))
        return 0
    if not cells:
        print("no cells")
        return 0
    print(f"{'CELL':>5}  {'ENDED':<12}  {'TIME':>8}  {'FROM':<7}  CODE")
    for cell in cells:
        print(
            f"{cell.number:>5}  {cell.end_reason:<12}  "
            f"{_duration(cell.execution.duration_ms):>8}  {cell.front_end:<7}  "
            f"{_snippet(cell.code)}"
        )
        for label, text in _outputs(cell):
            print(f"{'':>7}{label}: {_snippet(text)}")
    return 0


def _outputs(cell: Cell) -> list[tuple[str, str]]:
    """What a cell showed, as (label, text), for a glance."""
    execution = cell.execution
    shown = [("stdout", execution.logs.stdout), ("stderr", execution.logs.stderr)]
    shown += [
        ("result" if result.is_main_result else "display", describe(result))
        for result in execution.results
    ]
    if execution.error is not None:
        shown.append(("error", str(execution.error)))
    if execution.message:
        shown.append(("note", execution.message))
    return [(label, text) for label, text in shown if text.strip()]


def _snippet(text: str) -> str:
    """The first line with something on it, cut to SNIPPET_CHARS; `...` when there is more."""
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    lines = [line for line in lines if line.strip()] or [""]
    first = lines[0]
    if len(first) > SNIPPET_CHARS:
        return first[: SNIPPET_CHARS - 3] + "..."
    more = len(lines) - 1
    return f"{first} ... (+{more} line{'s' if more > 1 else ''})" if more else first


def _duration(ms: float) -> str:
    return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.2f} s"


def _cell_json(cell: Cell) -> dict[str, Any]:
    """A cell as the server's history has it (GET /v1/sessions/{id}/cells)."""
    execution = cell.execution
    error = execution.error
    return {
        "number": cell.number,
        "execution_count": execution.execution_count,
        "code": cell.code,
        "status": execution.status,
        "end_reason": execution.end_reason,
        "started_at": cell.started_at.isoformat(),
        "ended_at": cell.ended_at.isoformat(),
        "duration_s": execution.duration_ms / 1000,
        "stdout": execution.logs.stdout,
        "stderr": execution.logs.stderr,
        "result": execution.result.data if execution.result is not None else None,
        "displays": [r.data for r in execution.results if not r.is_main_result],
        "error": (
            {"ename": error.ename, "evalue": error.evalue, "traceback": error.traceback}
            if error is not None
            else None
        ),
        "files_changed": execution.files,
        "front_end": cell.front_end,
        "message": execution.message,
    }


@reports_errors("sessions show")
def _show(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        info = client.get_session(args.id)
    if args.json:
        print(json.dumps(_as_json(info), indent=2))
        return 0
    print(f"id         {info.id}")
    print(f"profile    {info.profile}")
    print(f"template   {info.template}")
    print(f"state      {info.state}")
    print(f"cells      {info.execution_count}")
    print(f"created    {info.created_at.isoformat()}")
    print(f"expires    {info.expires_at.isoformat()} (if left idle)")
    if info.last_cell:
        last = info.last_cell
        print(f"last cell  {last.get('number')} ({last.get('end_reason')})")
    for key, label in info.metadata.items():
        print(f"metadata   {key}={label}")
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
