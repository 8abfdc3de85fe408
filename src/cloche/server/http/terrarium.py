"""Terrarium's endpoint: `POST /` runs code in a fresh session, files in and out as base64.

Existing Terrarium clients work unchanged: they read one JSON object ending in a newline.
Each request gets a new session (from the warm `data` pool) that is discarded afterwards.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from cloche.errors import ClocheError, PathRefused
from cloche.protocol.paths import normalise
from cloche.server.http.auth import owner_of
from cloche.server.http.errors import JSONLineResponse
from cloche.server.http.models import TerrariumRequest, TerrariumResponse
from cloche.server.http.results import error_message, error_type
from cloche.sessions.manager import SessionManager
from cloche.sessions.result import CellResult, CellStatus

log = logging.getLogger("cloche.http")
router = APIRouter()


def failure(kind: str, message: str, status_code: int = 200, **extra: Any) -> JSONLineResponse:
    return JSONLineResponse(
        {"success": False, "error": {"type": kind, "message": message}, **extra},
        status_code=status_code,
    )


@router.post(
    "/",
    response_model=TerrariumResponse,
    response_class=JSONLineResponse,
    summary="Run code in a fresh sandbox (Terrarium-compatible)",
    responses={400: {"model": TerrariumResponse}},
)
async def run_once(
    body: TerrariumRequest, request: Request, owner: str | None = Depends(owner_of)
) -> Response:
    manager: SessionManager = request.app.state.manager
    if not body.code or not body.code.strip():
        return failure("parsing", "no code provided")
    inputs: list[tuple[str, bytes]] = []
    for item in body.files:
        try:
            normalise(item.filename)  # refuse a bad path before taking a sandbox
        except PathRefused as exc:
            return failure("parsing", str(exc), 400)
        try:
            inputs.append((item.filename, base64.b64decode(item.b64_data, validate=True)))
        except (binascii.Error, ValueError):
            return failure("parsing", f"file {item.filename!r}: b64_data is not valid base64", 400)
    info = await manager.create(owner, profile="data")
    try:
        try:
            await manager.write_files(info.id, inputs, owner)
        except PathRefused as exc:
            return failure("parsing", str(exc), 400)
        result = await manager.execute(
            info.id, body.code, owner=owner, track_files=True, front_end="terrarium"
        )
        outputs = await _read_all(manager, info.id, owner, result.files)
    finally:
        _discard(request, manager, info.id, owner)
    return JSONLineResponse(_answer(result, outputs))


async def _read_all(
    manager: SessionManager, session_id: str, owner: str | None, names: list[str]
) -> list[dict[str, str]]:
    out = []
    for name in names:
        try:
            data = await manager.read_file(session_id, name, owner)
        except (ClocheError, OSError) as exc:
            log.warning("output file %r not returned: %s", name, exc)
            continue
        out.append({"filename": name, "b64_data": base64.b64encode(data).decode("ascii")})
    return out


def _answer(result: CellResult, outputs: list[dict[str, str]]) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "success": result.status is CellStatus.OK,
        "std_out": result.stdout,
        "std_err": result.stderr,
        "code_runtime": round(result.duration_ms),
        "output_files": outputs,
    }
    if result.status is CellStatus.OK:
        if result.result is None:
            answer["final_expression"] = None
        elif "json" in result.result:
            answer["final_expression"] = result.result["json"]
        else:
            answer["final_expression"] = result.result_text
    else:
        answer["error"] = {"type": error_type(result), "message": error_message(result)}
    return answer


def _discard(request: Request, manager: SessionManager, session_id: str, owner: str | None) -> None:
    """Close the one-shot session without making the client wait for it."""
    tasks: set[asyncio.Task[None]] = request.app.state.background

    async def close() -> None:
        try:
            await manager.close(session_id, owner, reason="one-shot")
        except ClocheError:
            pass  # already gone (killed)

    task = asyncio.create_task(close())
    tasks.add(task)
    task.add_done_callback(tasks.discard)
