"""What crosses the data path between a front end and a node agent, as JSON.

Results, session descriptions and errors are turned into plain JSON values and back: no
pickle on a socket, so a peer that knows the cluster's secret can run cells, not host code.
"""

from __future__ import annotations

import base64
from dataclasses import asdict
from typing import Any

from cloche import errors
from cloche.sandbox.listing import FileInfo, FileListing
from cloche.sessions.commands import CommandResult, CommandSpec
from cloche.sessions.processes import Event, Exit, Output
from cloche.sessions.result import CellResult, CellStatus
from cloche.sessions.session import SessionInfo, SessionState
from cloche.sessions.store import SnapshotRecord

ACCEPTED = "accepted"  # an event of a streamed execute: the node queued the cell


def info_out(info: SessionInfo) -> dict[str, Any]:
    out = asdict(info)
    out["state"] = info.state.value
    return out


def info_in(raw: dict[str, Any]) -> SessionInfo:
    return SessionInfo(**{**raw, "state": SessionState(raw["state"])})


def result_out(result: CellResult) -> dict[str, Any]:
    out = asdict(result)
    out["status"] = result.status.value
    return out


def result_in(raw: dict[str, Any]) -> CellResult:
    streams = [(name, text) for name, text in raw["streams"]]
    return CellResult(**{**raw, "status": CellStatus(raw["status"]), "streams": streams})


def snapshot_out(record: SnapshotRecord) -> dict[str, Any]:
    return asdict(record)


def snapshot_in(raw: dict[str, Any]) -> SnapshotRecord:
    return SnapshotRecord(**raw)


def listing_out(listing: FileListing) -> dict[str, Any]:
    return asdict(listing)


def listing_in(raw: dict[str, Any]) -> FileListing:
    return FileListing(tuple(FileInfo(**f) for f in raw["files"]), raw["truncated"])


def bytes_out(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def bytes_in(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def error_out(exc: errors.ClocheError) -> dict[str, Any]:
    """An error as {"type", "message"} plus the fields its class is built from."""
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    for name in ("session_id", "snapshot_id", "path", "reason"):
        if hasattr(exc, name):
            out[name] = getattr(exc, name)
    return out


def error_in(raw: dict[str, Any]) -> errors.ClocheError:
    """The same error again on this side (ClocheError when the class is not known here)."""
    kind = getattr(errors, str(raw.get("type")), None)
    message = str(raw.get("message", ""))
    if not (isinstance(kind, type) and issubclass(kind, errors.ClocheError)):
        return errors.ClocheError(message)
    exc: errors.ClocheError
    if kind is errors.SessionNotFound:
        exc = errors.SessionNotFound(raw["session_id"])
    elif kind is errors.SessionMoved:
        exc = errors.SessionMoved(raw["session_id"])
    elif kind is errors.SnapshotNotFound:
        exc = errors.SnapshotNotFound(raw["snapshot_id"])
    elif kind is errors.PathNotFound:
        exc = errors.PathNotFound(raw["path"])
    elif kind is errors.PathRefused:
        exc = errors.PathRefused(raw["path"], raw["reason"])
    elif kind is errors.SessionLost:
        exc = errors.SessionLost(raw["session_id"])
        exc.args = (message,)  # its "why" as the agent said it
    elif kind is errors.FrameTooLarge:
        exc = errors.ClocheError(message)
    else:
        exc = kind(message)
    return exc


def spec_out(spec: CommandSpec) -> dict[str, Any]:
    out = asdict(spec)
    out["env"] = dict(spec.env)
    return out


def spec_in(raw: dict[str, Any]) -> CommandSpec:
    args, pty = raw.get("args"), raw.get("pty")
    return CommandSpec(
        **{
            **raw,
            "args": tuple(args) if args is not None else None,
            "pty": tuple(pty) if pty is not None else None,
        }
    )


def command_result_out(result: CommandResult) -> dict[str, Any]:
    return asdict(result)


def command_result_in(raw: dict[str, Any]) -> CommandResult:
    return CommandResult(**raw)


def run_event_out(event: dict[str, Any]) -> dict[str, Any]:
    """A foreground run's event: start {pid}, or stdout/stderr {data: bytes}."""
    if isinstance(event.get("data"), bytes):
        return {**event, "data": bytes_out(event["data"])}
    return event


def run_event_in(raw: dict[str, Any]) -> dict[str, Any]:
    if isinstance(raw.get("data"), str):
        return {**raw, "data": bytes_in(raw["data"])}
    return raw


def event_out(event: Event) -> dict[str, Any]:
    """A process's event, as the data path carries it."""
    if isinstance(event, Output):
        return {"out": event.fd, "pid": event.pid, "data": bytes_out(event.data)}
    return {
        "exit": event.exit_code,
        "pid": event.pid,
        "signal": event.signal,
        "suspended": event.suspended,
    }


def event_in(raw: dict[str, Any]) -> Event:
    if "out" in raw:
        return Output(int(raw["pid"]), int(raw["out"]), bytes_in(raw["data"]))
    return Exit(int(raw["pid"]), raw.get("exit"), raw.get("signal"), bool(raw.get("suspended")))
