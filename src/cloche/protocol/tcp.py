"""Messages of the REPL TCP protocol (see the TCP protocol spec): parsing and replies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cloche.errors import InvalidMessage

GREETING = {
    "status": "ok",
    "message": (
        'cloche ready: send {"code": "...", "session_id": "optional"} as a 4-byte '
        "big-endian length followed by UTF-8 JSON"
    ),
}


@dataclass(frozen=True)
class Request:
    """One request: code to run, in a session or in a new one."""

    code: str
    session_id: str | None = None  # None: create a new session
    timeout_s: float | None = None
    token: str | None = None
    profile: str = "lean"  # for a new session: lean, or data (the data stack imported)
    template: str | None = None  # for a new session: its system (None: the built-in python)


def parse_request(message: dict[str, Any]) -> Request:
    """Check a decoded request's fields; unknown fields are ignored.

    Raises:
        InvalidMessage: a field is missing or of the wrong type.
    """
    code = message.get("code")
    if not isinstance(code, str):
        raise InvalidMessage("Invalid request: 'code' must be a string")
    session_id = message.get("session_id")
    if session_id is not None and not isinstance(session_id, str):
        raise InvalidMessage("Invalid request: 'session_id' must be a string")
    timeout = message.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not _positive_finite(timeout)
    ):
        raise InvalidMessage("Invalid request: 'timeout' must be a positive number of seconds")
    token = message.get("token")
    if token is not None and not isinstance(token, str):
        raise InvalidMessage("Invalid request: 'token' must be a string")
    profile = message.get("profile", "lean")
    if not isinstance(profile, str):
        raise InvalidMessage("Invalid request: 'profile' must be a string")
    template = message.get("template")
    if template is not None and not isinstance(template, str):
        raise InvalidMessage("Invalid request: 'template' must be a string")
    return Request(
        profile=profile,
        template=template or None,
        code=code,
        session_id=session_id or None,
        timeout_s=float(timeout) if timeout is not None else None,
        token=token,
    )


def _positive_finite(number: int | float) -> bool:
    # JSON integers are unbounded: one too large for a float is no usable timeout.
    try:
        return math.isfinite(number) and number > 0
    except OverflowError:
        return False


def error_reply(error: str, **extra: Any) -> dict[str, Any]:
    return {"status": "error", "error": error, **extra}
