"""Turning a CellResult into the API's shapes."""

from __future__ import annotations

from typing import Any

from cloche.sessions.result import CellResult


def execute_body(result: CellResult) -> dict[str, Any]:
    """The full result of a cell, as the sessions API returns it."""
    return {
        "status": result.status.value,
        "end_reason": result.end_reason,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "result": result.result["data"] if result.result else None,
        "result_json": result.result.get("json") if result.result else None,
        "displays": result.displays,
        "error": result.error,
        "files": result.files,
        "duration_ms": round(result.duration_ms, 3),
        "execution_count": result.execution_count,
        "message": result.message,
        "session_alive": result.session_survived,
    }


def error_type(result: CellResult) -> str:
    """Terrarium's error type: the exception's name, or the limit that stopped the cell."""
    if result.status.value in ("timeout", "killed", "interrupted"):
        return result.status.value
    if result.error is None:
        return "error"
    if result.error["ename"] == "MemoryError":
        return "memory"
    if result.error["ename"] in ("SyntaxError", "IndentationError", "TabError"):
        return "parsing"
    return str(result.error["ename"])


def error_message(result: CellResult) -> str:
    parts = []
    if result.error is not None:
        parts.append("\n".join(result.error["traceback"]))
    if result.message:
        parts.append(result.message)
    return "\n".join(parts)
