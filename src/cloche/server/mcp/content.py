"""What cloche's MCP tools answer, as MCP content: a cell's outcome, a command's, a
session's history, a file; text with any lone surrogate escaped, so that the SDK can send
it."""

from __future__ import annotations

import base64
import contextlib
from typing import Any

from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ContentBlock, ImageContent, TextContent

from cloche.client.execution import Cell, Execution
from cloche.client.process import CommandResult
from cloche.errors import ClocheError
from cloche.server.jsonbody import map_leaves

HISTORY_OUTPUT_CHARS = 2000  # of each output of a cell, in session_history
IMAGE_MAGIC = {
    b"\x89PNG\r\n\x1a\n": "image/png",
    b"\xff\xd8\xff": "image/jpeg",
    b"GIF8": "image/gif",
}


def _images(execution: Execution) -> list[ContentBlock]:
    return [
        ImageContent(type="image", data=base64.b64encode(data).decode(), mime_type=kind)
        for result in execution.results
        for kind, data in result.images().items()
    ]


def execution_result(execution: Execution, note: str | None = None) -> CallToolResult:
    """An Execution as MCP content: a text summary, then any images."""
    header = (
        f"[session {execution.session_id}, cell {execution.execution_count}, "
        f"{execution.status}, {execution.duration_ms:.0f} ms]"
    )
    text = f"{header}\n{execution.to_text()}"
    if note:
        text = f"{text}\n\nnote: {note}"
    error = execution.error
    return CallToolResult(
        content=[TextContent(type="text", text=_sendable(text)), *_images(execution)],
        structured_content=_sendable(
            {
                "session_id": execution.session_id,
                "status": execution.status,
                "stdout": execution.logs.stdout,
                "stderr": execution.logs.stderr,
                "result": execution.text,
                "error": (
                    {"ename": error.ename, "evalue": error.evalue, "traceback": error.traceback}
                    if error
                    else None
                ),
                "execution_count": execution.execution_count,
                "duration_ms": execution.duration_ms,
            }
        ),
        is_error=execution.status != "ok",
    )


def command_result(
    result: CommandResult, session_id: str, note: str | None = None
) -> CallToolResult:
    """A finished command as MCP content: how it ended, then its stdout and stderr."""
    if result.exit_code is not None:
        ended = f"exit code {result.exit_code}"
    else:
        ended = result.status + (f" by {result.signal}" if result.signal else "")
    header = f"[session {session_id}, pid {result.pid}, {ended}, {result.duration_ms:.0f} ms]"
    parts = [header]
    for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            parts.append(f"{name}:\n{text.rstrip()}")
    if not (result.stdout or result.stderr):
        parts.append("(no output)")
    if note:
        parts.append(f"note: {note}")
    return CallToolResult(
        content=[TextContent(type="text", text=_sendable("\n".join(parts)))],
        structured_content=_sendable(
            {
                "session_id": session_id,
                "pid": result.pid,
                "exit_code": result.exit_code,
                "status": result.status,
                "end_reason": result.end_reason,
                "signal": result.signal,
                "stdout": result.stdout,
                "stderr": result.stderr,
                "duration_ms": result.duration_ms,
            }
        ),
        is_error=not result.ok,
    )


def _sendable(value: Any) -> Any:
    """Strs with any lone surrogate (user code can raise ValueError("\\ud800"), which
    UTF-8 can't encode and the SDK would fail to send) spelled as its escape, `\\ud800`."""
    return map_leaves(value, _escaped_surrogates)


def _escaped_surrogates(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def history_result(session_id: str, cells: list[Cell]) -> CallToolResult:
    """A session's cells as MCP content: per cell its code and what it showed, each output
    cut to HISTORY_OUTPUT_CHARS (images named, not sent)."""
    rows = []
    parts = []
    for cell in cells:
        execution = cell.execution
        error = execution.error
        shown = {
            "stdout": _cut(execution.logs.stdout),
            "stderr": _cut(execution.logs.stderr),
            "displays": _cut("".join(f"{r}\n" for r in execution.results if not r.is_main_result)),
            "result": _cut(execution.text or ""),
            "error": str(error) if error else "",
            "note": execution.message or "",
        }
        rows.append(
            {
                "number": cell.number,
                "code": cell.code,
                "status": execution.status,
                "end_reason": execution.end_reason,
                "stdout": shown["stdout"],
                "stderr": shown["stderr"],
                "result": shown["result"] if execution.text is not None else None,
                "error": {"ename": error.ename, "evalue": error.evalue} if error else None,
                "duration_ms": execution.duration_ms,
                "front_end": cell.front_end,
                "started_at": cell.started_at.isoformat(),
            }
        )
        outputs = [f"{name}:\n{text.rstrip()}" for name, text in shown.items() if text]
        parts.append(
            f"[cell {cell.number}, {execution.end_reason}, {execution.duration_ms:.0f} ms, "
            f"from {cell.front_end or 'unknown'}]\ncode:\n{cell.code}\n"
            + ("\n".join(outputs) or "(no output)")
        )
    text = "\n\n".join(parts) or f"Session {session_id} has no cells in its history."
    return CallToolResult(
        content=[TextContent(type="text", text=_sendable(text))],
        structured_content=_sendable({"session_id": session_id, "cells": rows}),
    )


def _cut(text: str) -> str:
    if len(text) <= HISTORY_OUTPUT_CHARS:
        return text
    more = len(text) - HISTORY_OUTPUT_CHARS
    return f"{text[:HISTORY_OUTPUT_CHARS]}\n[{more} more characters not shown]"


def file_content(path: str, data: bytes) -> list[ContentBlock]:
    for magic, kind in IMAGE_MAGIC.items():
        if data.startswith(magic):
            return [
                TextContent(type="text", text=f"{path}: {len(data)} bytes, {kind}"),
                ImageContent(type="image", data=base64.b64encode(data).decode(), mime_type=kind),
            ]
    try:
        text = data.decode()
    except UnicodeDecodeError:
        encoded = base64.b64encode(data).decode()
        return [
            TextContent(
                type="text", text=f"{path}: {len(data)} bytes of binary, base64:\n{encoded}"
            )
        ]
    return [TextContent(type="text", text=text)]


@contextlib.contextmanager
def as_tool_errors() -> Any:
    """cloche's exceptions become tool errors the model can read."""
    try:
        yield
    except ClocheError as exc:
        raise ToolError(f"{type(exc).__name__}: {exc}") from exc
