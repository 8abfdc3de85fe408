"""Commands of a session (`/v1/sessions/{id}/commands`): run, start, list, attach, stdin,
signal, kill. The processes are the session's (`sessions.commands`); this only translates.

A foreground run answers its whole result, or, with `Accept: text/event-stream` (or
`?stream=true`), `start {pid}`, then `stdout`/`stderr` events `{"data": text}` (or
`{"data": base64, "encoding": "base64"}` where the output is not UTF-8) as they happen,
then `end {exit_code, status, ...}`. A client that leaves a foreground stream kills its
command; an attached stream (GET .../commands/{pid}) only stops listening, and so does the
stream of a background start asked as events (`start {pid}`, its output from its first
byte, its end): the command runs on.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import codecs
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from cloche.errors import ClocheError, ProcessError
from cloche.server.http.auth import owner_of
from cloche.server.http.models import ErrorBody
from cloche.server.jsonbody import JSONBody, json_text
from cloche.sessions.commands import CommandResult, CommandSpec, signal_number
from cloche.sessions.manager import SessionManager
from cloche.sessions.processes import Exit, Output

log = logging.getLogger("cloche.http")
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 410, 501, 503)
}
router = APIRouter(prefix="/v1/sessions", tags=["commands"], responses=ERRORS)


class CommandIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cmd: str = Field(
        min_length=1,
        max_length=256 * 1024,
        description="A command line for the template's shell (bash -lc, or sh -c); with "
        "args, the program itself, executed directly",
    )
    args: list[str] | None = Field(default=None, description="The program's arguments")
    cwd: str | None = Field(default=None, description="Where it runs (default: the home)")
    env: dict[str, str] = Field(default_factory=dict, description="More environment")
    user: str | None = Field(
        default=None,
        max_length=64,
        description="Whom it runs as: the session's user by default, or root (inside the "
        "sandbox only; refused with --no-root), or another user of the image",
    )
    timeout: float | None = Field(
        default=None,
        ge=0,
        description="Seconds before its whole process group is killed (a foreground run: "
        "60 by default; 0: none); a background command has none unless given",
    )
    stdin: bool = Field(default=False, description="Keep its stdin open for POST .../stdin")
    background: bool = Field(default=False, description="Answer 201 {pid} at once")
    tag: str | None = Field(default=None, max_length=256, description="A label for listings")


class CommandOut(BaseModel):
    pid: int
    exit_code: int | None
    signal: str | None = None
    stdout: str
    stderr: str
    status: Literal["exited", "signaled", "timeout", "killed"]
    end_reason: str
    duration_ms: float


class Started(BaseModel):
    pid: int


class ProcessOut(BaseModel):
    pid: int
    cmd: str | None
    tag: str | None = None
    user: str | None = None
    cwd: str | None = None
    pty: bool = False
    started_at: float = Field(description="Unix time, s")


class ProcessList(BaseModel):
    commands: list[ProcessOut]


class StdinIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data: str = Field(default="", max_length=16 * 1024 * 1024)
    encoding: Literal["utf-8", "base64"] = "utf-8"
    eof: bool = Field(default=False, description="Close its stdin after data")


class SignalIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    signal: str | int = Field(description="A name (SIGTERM, TERM) or a number")


def _manager(request: Request) -> SessionManager:
    manager: SessionManager = request.app.state.manager
    return manager


def spec_of(body: CommandIn, *, pty: tuple[int, int] | None = None) -> CommandSpec:
    return CommandSpec(
        cmd=body.cmd,
        args=tuple(body.args) if body.args is not None else None,
        cwd=body.cwd,
        env=body.env,
        user=body.user,
        timeout_s=body.timeout,
        stdin=body.stdin,
        tag=body.tag,
        pty=pty,
    )


@router.post(
    "/{session_id}/commands",
    response_model=CommandOut,
    summary="Run a command (stream it with Accept: text/event-stream; background: 201, or "
    "its events from its first byte when streamed)",
    responses={200: {"content": {"text/event-stream": {}}}, 201: {"model": Started}},
)
async def run_command(
    session_id: str,
    body: CommandIn,
    request: Request,
    stream: bool = Query(False, description="Answer as Server-Sent Events"),
    owner: str | None = Depends(owner_of),
) -> Any:
    manager = _manager(request)
    spec = spec_of(body)
    streamed = stream or "text/event-stream" in request.headers.get("accept", "")
    if body.background and streamed:
        return await _stream_started(manager, session_id, spec, owner)
    if body.background:
        pid = await manager.start_command(session_id, spec, owner=owner, front_end="http")
        return JSONBody({"pid": pid}, status_code=201)
    if streamed:
        return await _stream_run(request, manager, session_id, spec, owner)
    result = await manager.run_command(session_id, spec, owner=owner, front_end="http")
    return JSONBody(result.to_json())


@router.get("/{session_id}/commands", response_model=ProcessList, summary="Running commands")
async def list_commands(
    session_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    found = await _manager(request).commands(session_id, owner)
    keys = ProcessOut.model_fields
    return {"commands": [{k: p.get(k) for k in keys if k in p} for p in found]}


@router.get(
    "/{session_id}/commands/{pid}",
    summary="Attach: its output from now on, then its end, as Server-Sent Events",
    responses={200: {"content": {"text/event-stream": {}}}},
    response_class=StreamingResponse,
)
async def attach(
    session_id: str, pid: int, request: Request, owner: str | None = Depends(owner_of)
) -> StreamingResponse:
    # ProcessNotFound and the like: a status, not a stream; then listening from now on.
    events = await _manager(request).watch_command(session_id, pid, owner)

    async def body() -> AsyncIterator[bytes]:
        encoder = _Encoder()
        try:
            async for event in events:
                yield encoder.frame(event)
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    return _sse_response(body())


@router.post("/{session_id}/commands/{pid}/stdin", status_code=204, summary="Write to stdin")
async def stdin(
    session_id: str,
    pid: int,
    body: StdinIn,
    request: Request,
    owner: str | None = Depends(owner_of),
) -> Response:
    try:
        data = base64.b64decode(body.data, validate=True) if body.encoding == "base64" else b""
    except (binascii.Error, ValueError):
        raise ProcessError("data is not valid base64") from None
    if body.encoding == "utf-8":
        data = body.data.encode()
    await _manager(request).command_input(session_id, pid, data, eof=body.eof, owner=owner)
    return Response(status_code=204)


@router.post("/{session_id}/commands/{pid}/signal", status_code=204, summary="Send a signal")
async def send_signal(
    session_id: str,
    pid: int,
    body: SignalIn,
    request: Request,
    owner: str | None = Depends(owner_of),
) -> Response:
    number = signal_number(body.signal)
    await _manager(request).signal_command(session_id, pid, number, owner)
    return Response(status_code=204)


@router.delete(
    "/{session_id}/commands/{pid}", status_code=204, summary="Kill it and all it started"
)
async def kill(
    session_id: str, pid: int, request: Request, owner: str | None = Depends(owner_of)
) -> Response:
    await _manager(request).kill_command(session_id, pid, owner)
    return Response(status_code=204)


async def _stream_started(
    manager: SessionManager, session_id: str, spec: CommandSpec, owner: str | None
) -> StreamingResponse:
    """A background start as events, from its first byte; leaving only stops listening."""
    pid, events = await manager.open_command(session_id, spec, owner=owner, front_end="http")

    async def body() -> AsyncIterator[bytes]:
        encoder = _Encoder()
        try:
            yield _sse("start", {"pid": pid})
            async for event in events:
                yield encoder.frame(event)
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    return _sse_response(body())


async def _stream_run(
    request: Request,
    manager: SessionManager,
    session_id: str,
    spec: CommandSpec,
    owner: str | None,
) -> StreamingResponse:
    """A foreground run as events; the client's leaving kills the command."""
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def on_event(event: dict[str, Any]) -> None:
        queue.put_nowait((event["type"], event))

    async def run() -> CommandResult:
        try:
            return await manager.run_command(
                session_id, spec, owner=owner, on_event=on_event, front_end="http"
            )
        finally:
            queue.put_nowait(("__done__", None))

    task = asyncio.create_task(run())
    started = asyncio.ensure_future(queue.get())
    await asyncio.wait([started, task], return_when=asyncio.FIRST_COMPLETED)
    if not started.done():  # refused before it started: a status of its own
        started.cancel()
        task.result()
    first = started.result()

    async def body() -> AsyncIterator[bytes]:
        encoder = _Encoder()
        try:
            kind, event = first
            while kind != "__done__":
                if kind == "start":
                    yield _sse("start", {"pid": event["pid"]})
                else:
                    yield encoder.output(kind, event["data"])
                kind, event = await queue.get()
            result = await task
            yield _sse("end", result.to_json())
        except ClocheError as exc:
            yield _sse("error", {"type": type(exc).__name__, "message": str(exc)})
        finally:
            if not task.done():
                log.info("command stream of session %s dropped: killing its command", session_id)
                task.cancel()  # run_command kills it and waits for its end

    return _sse_response(body())


def _sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json_text(data)}\n\n".encode("utf-8", "backslashreplace")


def _sse_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class _Encoder:
    """Output as SSE frames: text where it is UTF-8 (a character split between pieces is
    held for the next), base64 where it is not."""

    def __init__(self) -> None:
        self._decoders = {
            name: codecs.getincrementaldecoder("utf-8")() for name in ("stdout", "stderr")
        }

    def output(self, name: str, data: bytes) -> bytes:
        decoder = self._decoders[name]
        try:
            return _sse(name, {"data": decoder.decode(data)})
        except UnicodeDecodeError:
            pending, _ = decoder.getstate()
            decoder.reset()
            raw = base64.b64encode(pending + data).decode("ascii")
            return _sse(name, {"data": raw, "encoding": "base64"})

    def frame(self, event: Output | Exit) -> bytes:
        if isinstance(event, Output):
            return self.output("stdout" if event.fd == 1 else "stderr", event.data)
        result = CommandResult(event.pid, exit_code=event.exit_code, signal=event.signal)
        result.status = "exited" if event.signal is None else "signaled"
        if event.exit_code is None and event.signal is None:
            result.status = "killed"
        return _sse("end", {k: v for k, v in result.to_json().items() if k not in _OUTPUTS})


_OUTPUTS = ("stdout", "stderr", "duration_ms", "end_reason")
