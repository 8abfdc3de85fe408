"""The client's failures as the tree's exceptions: httpx's transport errors, the API's
error answers (worded by the server, with what to change), and cells the server refused."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from cloche.errors import (
    CellNotFound,
    CheckpointFailed,
    ClocheError,
    EgressRefused,
    Forbidden,
    InvalidMetadata,
    InvalidRequest,
    KernelDied,
    LLMBudgetExceeded,
    LLMError,
    LLMUnavailable,
    NotSupported,
    PackageInstallError,
    PathNotFound,
    PathRefused,
    PortUnreachable,
    ProcessError,
    ProcessNotFound,
    QuotaExceeded,
    RequestTimeout,
    RequestTooLarge,
    RestoreRefused,
    SandboxError,
    ServerUnreachable,
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
    UnexpectedResponse,
    VolumeExists,
    VolumeFull,
    VolumeInUse,
    VolumeNotFound,
    VolumeRefused,
)

# How long past a cell's own time limit to wait for its answer: the server's interrupt
# grace, a kill, and the trip back.
ANSWER_MARGIN_S = 30.0
_LLM_ERRORS: dict[str, type[LLMError]] = {
    "llm_unavailable": LLMUnavailable,
    "llm_budget": LLMBudgetExceeded,
    "llm_error": LLMError,
}
_QUOTAS = ("max_live_sessions", "max_paused_sessions", "max_snapshot_bytes", "max_volume_bytes")
_BY_STATUS: dict[int, type[ClocheError]] = {
    400: InvalidRequest,
    409: SessionBusy,
    413: RequestTooLarge,
    422: RestoreRefused,
    429: TooManySessions,
    503: SandboxError,
    507: StorageFull,
}
_BY_KIND: dict[str, type[ClocheError]] = {
    "checkpoint_failed": CheckpointFailed,
    "egress_refused": EgressRefused,
    "forbidden": Forbidden,
    "too_many_paused_sessions": TooManyPausedSessions,
    "template_exists": TemplateExists,
    "template_not_ready": TemplateNotReady,
    "template_failed": TemplateFailed,
    "template_in_use": TemplateInUse,
    "template_refused": TemplateRefused,
    "not_supported": NotSupported,
    "process_error": ProcessError,
    "port_unreachable": PortUnreachable,
    "volume_exists": VolumeExists,
    "volume_in_use": VolumeInUse,
    "volume_refused": VolumeRefused,
    "volume_full": VolumeFull,
}


def _with_message(exc: ClocheError, message: str) -> ClocheError:
    """The server already worded the message: keep it, whatever the class's own wording."""
    exc.args = (message,)
    return exc


@contextlib.asynccontextmanager
async def translated(
    url: str, timeout_s: float, cell_wait_s: float | None = None
) -> AsyncIterator[None]:
    """httpx's transport errors as the tree's ClientErrors.

    Args:
        url: the server's, for the messages.
        timeout_s: the client's timeout for ordinary requests.
        cell_wait_s: for a cell, how long its answer was awaited.
    """
    try:
        yield
    except httpx.TimeoutException as exc:
        if cell_wait_s is None:
            advice = (
                f"within {timeout_s:g} s; wait longer with timeout_s= "
                "(--request-timeout or CLOCHE_REQUEST_TIMEOUT on the command line)"
            )
        else:
            advice = (
                f"within the cell's time limit plus {ANSWER_MARGIN_S:g} s ({cell_wait_s:g} s); "
                "the server may be overloaded, or its sandbox stuck"
            )
        raise RequestTimeout(
            f"no answer from the cloche server at {url} {advice} ({type(exc).__name__})"
        ) from exc
    except httpx.ConnectError as exc:
        raise ServerUnreachable(
            f"can't reach a cloche server at {url} ({exc}); start one with "
            "`cloche serve`, or point the client at it with url= (--url on the command "
            "line, or CLOCHE_URL)"
        ) from exc
    except httpx.TransportError as exc:
        raise ServerUnreachable(
            f"the connection to the cloche server at {url} failed: {type(exc).__name__}: {exc}"
        ) from exc


def error_for(
    response: httpx.Response,
    *,
    url: str,
    token: str | None,
    session_id: str | None = None,
    file_path: str | None = None,
    snapshot_id: str | None = None,
    cell_number: int | None = None,
) -> ClocheError:
    """The exception for an error answer of the API, worded by the server where it can be."""
    status = response.status_code
    try:
        detail = response.json()["error"]
        kind, message = str(detail["type"]), str(detail["message"])
    except (ValueError, KeyError, TypeError):
        return UnexpectedResponse(
            f"{response.request.method} {response.request.url} answered HTTP {status} "
            "with something that is not the cloche API; is the URL (url=, --url, "
            "CLOCHE_URL) the server's HTTP port?",
            status,
        )
    if status == 401:
        if token:
            advice = "the token was refused: check token= (--token, CLOCHE_TOKEN)"
        else:
            advice = "this server needs a token: pass token= (--token, or CLOCHE_TOKEN)"
        return Unauthorized(f"{advice} [{url}: {message}]")
    if status == 404 and kind == "not_found":
        if session_id is not None and cell_number is not None and "has no cell" in message:
            return _with_message(CellNotFound(session_id, cell_number), message)
        if session_id is not None and message.startswith("Session "):
            return _with_message(SessionNotFound(session_id), message)  # "is gone: why" too
        if snapshot_id is not None and message.startswith("Snapshot "):
            return SnapshotNotFound(snapshot_id)
        if message.startswith("Volume "):
            return _with_message(VolumeNotFound(message.split()[1]), message)
        if file_path is not None:
            return _with_message(PathNotFound(file_path), message)
        if "is not running" in message:  # a command's pid
            return ProcessNotFound(message)
        if message.startswith("Template "):
            return _with_message(TemplateNotFound(message.split()[1]), message)
    if status == 410 and kind == "lost" and session_id is not None:
        return _with_message(SessionLost(session_id), message)
    if status == 400 and kind == "invalid_request" and message.startswith("metadata"):
        return InvalidMetadata(message)  # the server names the pair or the limit
    if status == 400 and kind == "path_refused":
        return _with_message(PathRefused(file_path or "", message), message)
    if kind == "package_install":
        return PackageInstallError(message)
    if kind in _LLM_ERRORS:
        return _LLM_ERRORS[kind](message)
    if kind == "quota_exceeded":
        try:
            retry_after_s = float(response.headers.get("retry-after", "1"))
        except ValueError:
            retry_after_s = 1.0
        quota = next((q for q in _QUOTAS if q in message), "")
        return QuotaExceeded(message, quota=quota, retry_after_s=retry_after_s)
    if kind in _BY_KIND:
        return _BY_KIND[kind](message)
    if status in _BY_STATUS:
        return _BY_STATUS[status](message)
    return UnexpectedResponse(f"HTTP {status} from {url} ({kind}): {message}", status)


def cell_refusal(error: dict[str, Any] | None, session_id: str) -> ClocheError:
    """Why the server could not run a cell at all (its stream's error event)."""
    name = str((error or {}).get("ename", ""))
    message = str((error or {}).get("evalue", "the server could not run the cell"))
    if name == "SessionNotFound":
        return SessionNotFound(session_id)
    if name == "SessionBusy":
        return SessionBusy(message)
    if name == "KernelDied":
        return KernelDied(message)
    return SandboxError(f"{name}: {message}" if name else message)
