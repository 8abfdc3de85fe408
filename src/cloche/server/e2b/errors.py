"""Errors as E2B's clients read them.

The control plane answers `{"code": <HTTP status>, "message"}` (the SDK reads `code` and
`message`, and fails with a KeyError on any other shape), with the statuses the SDK maps to
its exceptions: 400 InvalidArgument, 401 Authentication, 404 NotFound, 409 (a pause of a
paused sandbox), 429 RateLimit, 503 ServiceBusy. envd's HTTP routes (`/files`, `/health`)
answer the same shape; its Connect services answer Connect errors (`ConnectError` with a
`Code`); the code interpreter answers plain text, as E2B's does.
"""

from __future__ import annotations

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from starlette.responses import JSONResponse

from cloche.errors import (
    ClocheError,
    EgressRefused,
    Forbidden,
    InvalidEnvironment,
    InvalidMetadata,
    NotSupported,
    PathNotFound,
    PathRefused,
    ProcessError,
    ProcessNotFound,
    QuotaExceeded,
    SandboxError,
    SessionBusy,
    SessionLost,
    SessionNotFound,
    SnapshotNotFound,
    StorageFull,
    TemplateError,
    TemplateNotFound,
    TooManyPausedSessions,
    TooManySessions,
    Unauthorized,
    UnknownProfile,
)

GONE = "was not found"  # how the SDK tells a sandbox that is gone from a 502 (is_running())

# (condition, HTTP status), most specific first.
_STATUS: tuple[tuple[type[ClocheError], int], ...] = (
    (SessionNotFound, 404),
    (SessionLost, 404),
    (SnapshotNotFound, 404),
    (TemplateNotFound, 404),
    (PathNotFound, 404),
    (ProcessNotFound, 404),
    (Unauthorized, 401),
    (Forbidden, 403),
    (EgressRefused, 403),
    (TooManySessions, 429),
    (QuotaExceeded, 429),
    (TooManyPausedSessions, 429),
    (SessionBusy, 409),
    (StorageFull, 507),
    (NotSupported, 501),
    (InvalidMetadata, 400),
    (InvalidEnvironment, 400),
    (UnknownProfile, 400),
    (TemplateError, 400),
    (ProcessError, 400),
    (PathRefused, 400),
    (SandboxError, 503),
)


class E2BError(Exception):
    """A request E2B's way refused: its status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def status_of(exc: ClocheError) -> int:
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return status
    return 500


def error_json(status: int, message: str) -> JSONResponse:
    """The control plane's and envd's error body."""
    return JSONResponse({"code": status, "message": message}, status_code=status)


def from_exception(exc: Exception) -> JSONResponse:
    """A cloche error (or an E2BError) as E2B's error body."""
    if isinstance(exc, E2BError):
        return error_json(exc.status, exc.message)
    if isinstance(exc, PathRefused) and exc.code in ("ENOSPC", "EDQUOT"):
        return error_json(507, str(exc))  # the SDK's NotEnoughSpaceException
    if isinstance(exc, ClocheError):
        return error_json(status_of(exc), str(exc))
    raise exc


_CODES: dict[int, Code] = {
    400: Code.INVALID_ARGUMENT,
    401: Code.UNAUTHENTICATED,
    403: Code.PERMISSION_DENIED,
    404: Code.NOT_FOUND,
    409: Code.ALREADY_EXISTS,
    429: Code.RESOURCE_EXHAUSTED,
    501: Code.UNIMPLEMENTED,
    502: Code.UNAVAILABLE,
    503: Code.UNAVAILABLE,
    507: Code.RESOURCE_EXHAUSTED,
}
_ERRNO_CODES: dict[str, Code] = {
    "EEXIST": Code.ALREADY_EXISTS,
    "EACCES": Code.PERMISSION_DENIED,
    "EPERM": Code.PERMISSION_DENIED,
    "ENOSPC": Code.RESOURCE_EXHAUSTED,
    "EDQUOT": Code.RESOURCE_EXHAUSTED,
    "ETIMEDOUT": Code.DEADLINE_EXCEEDED,
}


def connect_error(exc: ClocheError) -> ConnectError:
    """A cloche error as envd's Connect services answer it."""
    if isinstance(exc, PathRefused) and exc.code in _ERRNO_CODES:
        return ConnectError(_ERRNO_CODES[exc.code], str(exc))
    return ConnectError(_CODES.get(status_of(exc), Code.INTERNAL), str(exc))
