"""What a cell produced, as the client SDK hands it over (see the execution spec), and a
cell as a session's history keeps it (`Cell`).

An error in the user's code is data here (`Execution.error`), never an exception.
"""

from __future__ import annotations

import base64
import binascii
import datetime
from dataclasses import dataclass, field
from typing import Any

# MIME types of a bundle that hold base64 bytes, not text.
_BINARY = ("image/png", "image/jpeg", "image/gif", "image/webp")


@dataclass(frozen=True)
class Result:
    """One MIME bundle: the cell's last expression, or something `display()`ed.

    `data` maps MIME types to values as the server sent them (images as base64 text);
    the properties decode the common ones.
    """

    data: dict[str, Any]
    is_main_result: bool = False  # the value of the cell's last expression, not a display

    @property
    def formats(self) -> list[str]:
        """The MIME types present."""
        return list(self.data)

    @property
    def text(self) -> str | None:
        """text/plain: the repr."""
        return self._str("text/plain")

    @property
    def html(self) -> str | None:
        return self._str("text/html")

    @property
    def markdown(self) -> str | None:
        return self._str("text/markdown")

    @property
    def latex(self) -> str | None:
        return self._str("text/latex")

    @property
    def svg(self) -> str | None:
        return self._str("image/svg+xml")

    @property
    def json(self) -> Any:
        """application/json, decoded (None when absent)."""
        return self.data.get("application/json")

    @property
    def png(self) -> bytes | None:
        """image/png, as bytes."""
        return self._bytes("image/png")

    @property
    def jpeg(self) -> bytes | None:
        """image/jpeg, as bytes."""
        return self._bytes("image/jpeg")

    def images(self) -> dict[str, bytes]:
        """Every image in the bundle, by MIME type, as bytes."""
        found = {kind: self._bytes(kind) for kind in _BINARY}
        return {kind: data for kind, data in found.items() if data is not None}

    def _str(self, kind: str) -> str | None:
        value = self.data.get(kind)
        return value if isinstance(value, str) else None

    def _bytes(self, kind: str) -> bytes | None:
        value = self.data.get(kind)
        if not isinstance(value, str):
            return None
        try:
            return base64.b64decode(value)
        except (binascii.Error, ValueError):
            return None

    def __str__(self) -> str:
        return self.text or f"<{', '.join(self.formats)}>"


@dataclass(frozen=True)
class Logs:
    """Everything the cell wrote to stdout and to stderr."""

    stdout: str = ""
    stderr: str = ""


@dataclass(frozen=True)
class ExecutionError:
    """The exception the user's code raised (data, not an exception of the SDK)."""

    ename: str
    evalue: str
    traceback: list[str] = field(default_factory=list)

    @property
    def traceback_text(self) -> str:
        return "\n".join(self.traceback) if self.traceback else f"{self.ename}: {self.evalue}"

    def __str__(self) -> str:
        return f"{self.ename}: {self.evalue}"


@dataclass(frozen=True)
class Execution:
    """The outcome of one cell.

    Attributes:
        status: `ok`, `error` (the code raised), `timeout`, `interrupted`, or `killed`
            (the sandbox died; the session is gone).
        end_reason: finer than status, why the cell ended: `ok`, `error`, `timeout`,
            `interrupted`, `memory` (MemoryError, or the memory cgroup's OOM kill),
            `output_limit`, `killed` (it ignored its interrupt), `sandbox_died`.
        results: MIME bundles in the order they appeared: `display()`s and figures,
            then the value of the last expression (`is_main_result`).
        logs: stdout and stderr.
        error: the exception the code raised, with its traceback, or None.
        duration_ms: wall time of the cell in the sandbox.
        execution_count: the cell's number in its session.
        files: files the cell created or changed in the working directory.
        message: what cloche says about a limit hit or a lost sandbox.
        session_alive: False when the session ended with this cell.
        result_json: the last expression's value when it is JSON-native.
        session_id: the session it ran in.
        output_files: contents of `files`, filled by the one-shot `run()` only.
    """

    status: str
    results: list[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: ExecutionError | None = None
    duration_ms: float = 0.0
    execution_count: int = 0
    files: list[str] = field(default_factory=list)
    message: str | None = None
    session_alive: bool = True
    result_json: Any = None
    session_id: str | None = None
    output_files: dict[str, bytes] = field(default_factory=dict)
    end_reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def result(self) -> Result | None:
        """The value of the cell's last expression, when there is one."""
        for result in self.results:
            if result.is_main_result:
                return result
        return None

    @property
    def text(self) -> str | None:
        """The last expression's repr (text/plain), when there is one."""
        main = self.result
        return main.text if main is not None else None

    def to_text(self) -> str:
        """The outcome as plain text for a language model: streams, result, error."""
        parts = []
        if self.logs.stdout:
            parts.append(f"stdout:\n{self.logs.stdout.rstrip(chr(10))}")
        if self.logs.stderr:
            parts.append(f"stderr:\n{self.logs.stderr.rstrip(chr(10))}")
        for result in self.results:
            label = "result" if result.is_main_result else "display"
            images = ", ".join(result.images())
            shown = result.text or ""
            if images:
                shown = f"{shown} [{images} attached]".strip()
            parts.append(f"{label}:\n{shown}")
        if self.error is not None:
            parts.append(f"error:\n{self.error.traceback_text}")
        if self.message:
            parts.append(f"note: {self.message}")
        if not parts:
            parts.append("(no output)")
        if self.status != "ok":
            parts.insert(0, f"status: {self.status}")
        return "\n\n".join(parts)


def execution_from_json(body: dict[str, Any], session_id: str | None = None) -> Execution:
    """An Execution from the sessions API's full cell result (`done` event or JSON)."""
    results = [Result(dict(bundle)) for bundle in body.get("displays") or []]
    if body.get("result") is not None:
        results.append(Result(dict(body["result"]), is_main_result=True))
    error = body.get("error")
    status = str(body.get("status", "error"))
    return Execution(
        status=status,
        results=results,
        logs=Logs(stdout=body.get("stdout") or "", stderr=body.get("stderr") or ""),
        error=(
            ExecutionError(
                ename=str(error.get("ename", "")),
                evalue=str(error.get("evalue", "")),
                traceback=[str(line) for line in error.get("traceback") or []],
            )
            if error
            else None
        ),
        duration_ms=float(body.get("duration_ms") or 0.0),
        execution_count=int(body.get("execution_count") or 0),
        files=[str(name) for name in body.get("files") or []],
        message=body.get("message"),
        session_alive=bool(body.get("session_alive", True)),
        result_json=body.get("result_json"),
        session_id=session_id,
        end_reason=str(body.get("end_reason") or status),
    )


@dataclass(frozen=True)
class Cell:
    """One cell of a session's history: what ran, when, from where, and its outcome.

    Attributes:
        number: its place in the session's life, from 1 (`session.cell(number)`); unlike
            `execution.execution_count`, a restart does not start it again.
        code: the source as it was sent.
        started_at: when it started (UTC).
        ended_at: when it ended (UTC).
        front_end: which front end sent it: http, tcp, mcp, jupyter, ui.
        execution: its outcome, as `run` returned it: status, end_reason, logs (each cut
            to the server's --history-output-bytes, with a marker), results (images over
            1 MiB named only), error, files changed, duration_ms, message.
    """

    number: int
    code: str
    started_at: datetime.datetime
    ended_at: datetime.datetime
    front_end: str
    execution: Execution

    @property
    def end_reason(self) -> str:
        return self.execution.end_reason


def cell_from_json(body: dict[str, Any], session_id: str | None = None) -> Cell:
    """A Cell from the sessions API's history entry (GET /v1/sessions/{id}/cells)."""
    outcome = {
        **body,
        "duration_ms": float(body.get("duration_s") or 0.0) * 1000,
        "files": body.get("files_changed") or [],
        "session_alive": body.get("status") != "killed",
    }
    return Cell(
        number=int(body["number"]),
        code=str(body.get("code", "")),
        started_at=_utc(body.get("started_at")),
        ended_at=_utc(body.get("ended_at")),
        front_end=str(body.get("front_end") or ""),
        execution=execution_from_json(outcome, session_id=session_id),
    )


def _utc(unix_s: Any) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(float(unix_s or 0.0), datetime.UTC)
