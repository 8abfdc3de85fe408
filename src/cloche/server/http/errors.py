"""Errors as JSON with fitting status codes: never a bare 500 for a client's mistake."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from cloche.errors import (
    CellNotFound,
    CheckpointFailed,
    ClocheError,
    EgressRefused,
    Forbidden,
    ForkRefused,
    InvalidEnvironment,
    InvalidMetadata,
    LLMBudgetExceeded,
    LLMError,
    LLMUnavailable,
    NodeNotFound,
    NotSupported,
    PackageInstallError,
    PathNotFound,
    PathRefused,
    PortUnreachable,
    ProcessError,
    ProcessNotFound,
    QuotaExceeded,
    RestoreRefused,
    SandboxError,
    SessionBusy,
    SessionLost,
    SessionNotFound,
    SnapshotNotFound,
    StorageFull,
    TemplateExists,
    TemplateFailed,
    TemplateInUse,
    TemplateNotFound,
    TemplateNotReady,
    TemplateRefused,
    TooManyPausedSessions,
    TooManySessions,
    Unauthorized,
    UnknownProfile,
    VolumeError,
    VolumeExists,
    VolumeFull,
    VolumeInUse,
    VolumeNotFound,
    VolumeRefused,
)
from cloche.server.jsonbody import JSONBody, json_bytes

log = logging.getLogger("cloche.http")

# (status, type) for each condition, most specific first.
_STATUS: tuple[tuple[type[ClocheError], int, str], ...] = (
    (SessionNotFound, 404, "not_found"),
    (SessionLost, 410, "lost"),
    (SnapshotNotFound, 404, "not_found"),
    (CellNotFound, 404, "not_found"),
    (InvalidMetadata, 400, "invalid_request"),
    (InvalidEnvironment, 400, "invalid_request"),
    (NodeNotFound, 404, "not_found"),
    (RestoreRefused, 422, "restore_refused"),
    (StorageFull, 507, "storage_full"),
    (CheckpointFailed, 503, "checkpoint_failed"),
    (TooManyPausedSessions, 429, "too_many_paused_sessions"),
    (ForkRefused, 400, "invalid_request"),
    (PathNotFound, 404, "not_found"),
    (ProcessNotFound, 404, "not_found"),
    (NotSupported, 501, "not_supported"),
    (PortUnreachable, 502, "port_unreachable"),
    (ProcessError, 400, "process_error"),
    (PathRefused, 400, "path_refused"),
    (SessionBusy, 409, "busy"),
    (TooManySessions, 429, "too_many_sessions"),
    (QuotaExceeded, 429, "quota_exceeded"),
    (Unauthorized, 401, "unauthorized"),
    (Forbidden, 403, "forbidden"),
    (UnknownProfile, 400, "invalid_request"),
    (EgressRefused, 403, "egress_refused"),
    (SandboxError, 503, "unavailable"),
    (LLMUnavailable, 404, "llm_unavailable"),
    (LLMBudgetExceeded, 429, "llm_budget"),
    (LLMError, 502, "llm_error"),
    (PackageInstallError, 422, "package_install"),
    (TemplateNotFound, 404, "not_found"),
    (TemplateExists, 409, "template_exists"),
    (TemplateNotReady, 409, "template_not_ready"),
    (TemplateFailed, 409, "template_failed"),
    (TemplateInUse, 409, "template_in_use"),
    (TemplateRefused, 400, "template_refused"),
    (VolumeNotFound, 404, "not_found"),
    (VolumeExists, 409, "volume_exists"),
    (VolumeInUse, 409, "volume_in_use"),
    (VolumeRefused, 400, "volume_refused"),
    (VolumeFull, 507, "volume_full"),
    (VolumeError, 503, "volume_error"),
)


class BodyTooLarge(ClocheError):
    """The request body is above the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body above the limit of {limit} bytes (--max-frame-bytes)")


TERRARIUM_PATH = "/"


class JSONLineResponse(JSONBody):
    """JSON followed by a newline: Terrarium's client reads up to the first one."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content) + b"\n"


def error_response(
    status: int,
    kind: str,
    message: str,
    path: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error as JSON; on Terrarium's endpoint in its shape, ending in a newline."""
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    error = {"type": kind, "message": message}
    if path == TERRARIUM_PATH:
        return JSONLineResponse(
            {"success": False, "error": error}, status_code=status, headers=headers
        )
    return JSONBody({"error": error}, status_code=status, headers=headers)


def status_of(exc: ClocheError) -> tuple[int, str]:
    for kind, status, name in _STATUS:
        if isinstance(exc, kind):
            return status, name
    if isinstance(exc, BodyTooLarge):
        return 413, "too_large"
    return 500, "internal"


def install(app: FastAPI) -> None:
    """Answer every failure as {"error": {"type", "message"}}."""

    def rejected(request: Request, reason: str) -> None:
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.rejected.labels("http", reason).inc()

    @app.exception_handler(ClocheError)
    async def cloche_error(request: Request, exc: ClocheError) -> JSONResponse:
        status, kind = status_of(exc)
        rejected(request, kind)
        if status == 500:
            log.error("request failed: %s", exc)
        headers = None
        if isinstance(exc, QuotaExceeded):
            headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
        return error_response(status, kind, str(exc), request.url.path, headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        rejected(request, "invalid_request")
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
            for e in exc.errors()
        )
        return error_response(
            400, "invalid_request", problems or "invalid request", request.url.path
        )

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, kind, str(exc.detail), request.url.path)
