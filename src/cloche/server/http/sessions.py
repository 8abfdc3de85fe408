"""The sessions API (`/v1/sessions`): create, run cells (whole or streamed), files, close."""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cloche.config import Limits
from cloche.errors import ClocheError, PathRefused, UnknownProfile
from cloche.llm.context import put_context_value
from cloche.protocol.paths import normalise
from cloche.server.http.auth import caller_of, owner_of
from cloche.server.http.models import (
    EgressAsk,
    ErrorBody,
    ExecuteRequest,
    ExecuteResponse,
    FileList,
    InputRequest,
    InputResponse,
    InterruptResponse,
    SessionCreate,
    SessionList,
    SessionOut,
)
from cloche.server.http.results import execute_body
from cloche.server.jsonbody import JSONBody, json_text
from cloche.server.tenants import Caller
from cloche.sessions.manager import SessionManager
from cloche.sessions.result import CellResult
from cloche.sessions.session import SessionInfo

log = logging.getLogger("cloche.http")
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 410, 413, 422, 429, 503)
}
# Uploads are streamed into the working directory: bodies here may be as large as it is.
UPLOAD_PATH = re.compile(r"^/v1/sessions/[^/]+/files/.+$")

router = APIRouter(prefix="/v1/sessions", tags=["sessions"], responses=ERRORS)


def _manager(request: Request) -> SessionManager:
    manager: SessionManager = request.app.state.manager
    return manager


def _iso(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).isoformat()


def _session_out(info: SessionInfo, limits: Limits, timeout_s: float) -> dict[str, Any]:
    expires = min(info.created_at + limits.lifetime_s, info.last_active + limits.idle_timeout_s)
    return {
        "id": info.id,
        "profile": info.profile,
        "template": info.template,
        "state": info.state.value,
        "created_at": _iso(info.created_at),
        "expires_at": _iso(expires),
        "execution_count": info.execution_count,
        "egress": info.egress,
        "metadata": info.metadata,
        "last_cell": info.last_cell,
        "queued_cells": info.queued_cells,
        "cpu_s": info.cpu_s,
        "memory_bytes": info.memory_bytes,
        "volumes": info.volumes,
        "limits": {
            "cell_timeout_s": timeout_s,
            "memory_mib": limits.memory_mib,
            "disk_mib": limits.disk_mib,
            "output_bytes": limits.output_bytes,
            "nproc": limits.nproc,
            "idle_timeout_s": limits.idle_timeout_s,
            "lifetime_s": limits.lifetime_s,
        },
    }


def describe(request: Request, info: SessionInfo) -> dict[str, Any]:
    limits: Limits = request.app.state.limits
    return _session_out(info, limits, info.cell_timeout_s or limits.cell_timeout_s)


@router.post("", status_code=201, response_model=SessionOut, summary="Create a session")
async def create_session(
    request: Request, body: SessionCreate | None = None, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    body = body or SessionCreate()
    manager = _manager(request)
    limits: Limits = request.app.state.limits
    inputs = []
    for item in body.files:
        normalise(item.filename)  # refuse a bad path before taking a sandbox
        try:
            inputs.append((item.filename, base64.b64decode(item.b64_data, validate=True)))
        except (binascii.Error, ValueError):
            raise PathRefused(item.filename, "b64_data is not valid base64") from None
    if body.snapshot is not None and "profile" in body.model_fields_set:
        raise UnknownProfile(
            "a session restored from a snapshot takes the snapshot's profile: leave out profile"
        )
    egress = body.egress
    asked = egress.model_dump(exclude_none=True) if isinstance(egress, EgressAsk) else egress
    info = await manager.create(
        owner,
        profile=body.profile,
        snapshot=body.snapshot,
        egress=asked,
        metadata=body.metadata,
        cell_timeout_s=body.timeout,
        template=body.template,
        env=body.env,
        volumes=[v.model_dump() for v in body.volumes] or None,
    )
    try:
        await manager.write_files(info.id, inputs, owner)
        if body.context is not None:
            await put_context_value(manager, info.id, owner, body.context)
    except BaseException:
        await manager.close(info.id, owner, reason="failed-setup")
        raise
    if body.timeout is not None:  # for the front ends that still look it up here
        request.app.state.session_timeouts[info.id] = min(body.timeout, limits.cell_timeout_s)
    return describe(request, await manager.info(info.id, owner))


@router.get("", response_model=SessionList, summary="The caller's sessions")
async def list_sessions(
    request: Request,
    every: bool = Query(
        False,
        alias="all",
        description="An admin's: every tenant's sessions (a user's: still its own)",
    ),
    state: str | None = Query(None, description="Only those in this state (idle, busy, paused)"),
    profile: str | None = Query(None, description="Only those of this profile"),
    caller: Caller = Depends(caller_of),  # noqa: B008
) -> dict[str, Any]:
    """Also `?metadata.<key>=<value>` (any number): only those carrying every such pair."""
    labels = {
        key.removeprefix("metadata."): value
        for key, value in request.query_params.items()
        if key.startswith("metadata.")
    }
    infos = await _manager(request).sessions(
        caller.token,
        every=every and caller.sees_all,
        state=state,
        profile=profile,
        metadata=labels,
    )
    return {"sessions": [describe(request, i) for i in infos]}


@router.get("/{session_id}", response_model=SessionOut, summary="One session")
async def get_session(
    session_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    return describe(request, await _manager(request).info(session_id, owner))


@router.post(
    "/{session_id}/restart",
    response_model=SessionOut,
    summary="A fresh interpreter, same id: variables and imports go, files stay",
)
async def restart_session(
    session_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    return describe(request, await _manager(request).restart(session_id, owner))


@router.delete("/{session_id}", status_code=204, summary="Close a session")
async def delete_session(
    session_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> Response:
    await _manager(request).close(session_id, owner, reason="deleted")
    request.app.state.session_timeouts.pop(session_id, None)
    return Response(status_code=204)


def _wants_stream(request: Request, stream: bool) -> bool:
    return stream or "text/event-stream" in request.headers.get("accept", "")


@router.post(
    "/{session_id}/execute",
    response_model=ExecuteResponse,
    summary="Run a cell (add ?stream=true or Accept: text/event-stream for SSE)",
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def execute(
    session_id: str,
    body: ExecuteRequest,
    request: Request,
    stream: bool = Query(False, description="Answer as Server-Sent Events"),
    owner: str | None = Depends(owner_of),
) -> Any:
    manager = _manager(request)
    await manager.info(session_id, owner)  # 404 now, not inside a stream
    timeouts: dict[str, float] = request.app.state.session_timeouts
    timeout = body.timeout or timeouts.get(session_id)
    if _wants_stream(request, stream):
        return await _stream(
            request, manager, session_id, body.code, timeout, owner, body.allow_stdin
        )
    result = await manager.execute(
        session_id, body.code, owner=owner, timeout_s=timeout, track_files=True, front_end="http"
    )
    # Returned as a Response, FastAPI doesn't validate and serialise it again (~0.1 ms).
    return JSONBody(execute_body(result))


router.add_api_route(
    "/{session_id}/completions",
    execute,
    methods=["POST"],
    response_model=ExecuteResponse,
    summary="Run a cell (an alias of execute)",
)


def _sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json_text(data)}\n\n".encode("utf-8", "backslashreplace")


async def _stream(
    request: Request,
    manager: SessionManager,
    session_id: str,
    code: str,
    timeout_s: float | None,
    owner: str | None,
    stdin: bool = False,
) -> StreamingResponse:
    """Events as output happens; a client that goes away interrupts the cell. With stdin,
    the cell's input() is an `input_request` event, answered by POST .../input.

    Raises:
        SessionBusy: the session's queue is full (answered 409, not as a stream).
    """
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    refused: list[ClocheError] = []
    running = False  # an event came: the session's running cell is this one
    accepted = asyncio.Event()  # the cell is queued (not refused as busy)

    def on_event(event: dict[str, Any]) -> None:
        nonlocal running
        running = True
        kind = event.pop("type")
        events.put_nowait((kind, event.get("data") if kind == "display" else event))

    async def run() -> None:
        try:
            result = await manager.execute(
                session_id,
                code,
                owner=owner,
                timeout_s=timeout_s,
                on_event=on_event,
                track_files=True,
                stdin=stdin,
                front_end="http",
                accepted=accepted,
            )
        except ClocheError as exc:
            refused.append(exc)
            events.put_nowait(
                ("error", {"ename": type(exc).__name__, "evalue": str(exc), "traceback": []})
            )
            events.put_nowait(("done", None))
            return
        events.put_nowait(("__result__", result))

    task = asyncio.create_task(run())
    background: set[asyncio.Task[None]] = request.app.state.background
    background.add(task)
    task.add_done_callback(background.discard)
    # The answer waits until the cell is queued or refused (a full queue: SessionBusy, on
    # this machine at once, on a cluster's node when it says so): a refusal gets its status
    # code, not a 200 stream.
    accepting = asyncio.ensure_future(accepted.wait())
    await asyncio.wait([accepting, task], return_when=asyncio.FIRST_COMPLETED)
    accepting.cancel()
    if refused:
        raise refused[0]

    async def body() -> AsyncIterator[bytes]:
        finished = False
        try:
            while True:
                kind, data = await events.get()
                if kind == "__result__":
                    result: CellResult = data
                    full = execute_body(result)
                    if full["result"] is not None:
                        yield _sse("result", full["result"])
                    if full["error"] is not None:
                        yield _sse("error", full["error"])
                    finished = True
                    yield _sse("done", full)
                    return
                if kind == "done":
                    finished = True
                    return
                yield _sse(kind, data)
        finally:
            if not finished and not task.done():
                log.info("stream of session %s dropped: stopping its cell", session_id)
                if running:
                    # In a task of its own: this body is being cancelled (the client left),
                    # and an interrupt sent to another node must not be cancelled with it.
                    stop = asyncio.create_task(_interrupt_quietly(manager, session_id, owner))
                    background.add(stop)
                    stop.add_done_callback(background.discard)
                else:
                    # The cell may still wait behind another request's, which an interrupt
                    # would hit: cancelling takes it out of the queue, or, if it started
                    # meanwhile, interrupts it (and only it).
                    task.cancel()

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _interrupt_quietly(manager: SessionManager, session_id: str, owner: str | None) -> None:
    try:
        await manager.interrupt(session_id, owner)
    except ClocheError:
        pass  # it ended, or the session went, meanwhile


@router.post(
    "/{session_id}/interrupt", response_model=InterruptResponse, summary="Interrupt the cell"
)
async def interrupt(
    session_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, bool]:
    return {"interrupted": await _manager(request).interrupt(session_id, owner)}


@router.post(
    "/{session_id}/input",
    response_model=InputResponse,
    summary="Answer the running cell's input() (after its input_request event)",
    responses={409: {"description": "No input() is waiting in this session"}},
)
async def answer_input(
    session_id: str, body: InputRequest, request: Request, owner: str | None = Depends(owner_of)
) -> Any:
    if not await _manager(request).answer_input(session_id, body.value, owner):
        return JSONResponse(
            {"detail": f"no input() is waiting in session {session_id}"}, status_code=409
        )
    return {"answered": True}


@router.get("/{session_id}/files", response_model=FileList, summary="List the working directory")
async def list_files(
    session_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    listing = await _manager(request).list_files(session_id, owner)
    return {
        "files": [
            {"path": f.path, "size_bytes": f.size_bytes, "modified": f.modified}
            for f in listing.files
        ],
        "truncated": listing.truncated,
    }


@router.get(
    "/{session_id}/files/{path:path}",
    summary="Download a file",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def download(
    session_id: str, path: str, request: Request, owner: str | None = Depends(owner_of)
) -> Response:
    size, pieces = await _manager(request).read_stream(session_id, path, owner)
    return StreamingResponse(
        pieces,
        media_type="application/octet-stream",
        headers={"content-length": str(size)},
    )


@router.put("/{session_id}/files/{path:path}", status_code=204, summary="Upload a file (raw body)")
async def upload(
    session_id: str, path: str, request: Request, owner: str | None = Depends(owner_of)
) -> Response:
    manager = _manager(request)
    await manager.info(session_id, owner)  # an unknown session is told before the body is read
    # Written as it comes (in pieces, over a cluster's data path too): a file as large as
    # the working directory (--disk-mib) without holding it here.
    await manager.write_stream(session_id, path, request.stream(), owner)
    return Response(status_code=204)
