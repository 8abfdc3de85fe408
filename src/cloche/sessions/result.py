"""What a cell produced, in Jupyter's vocabulary (see the execution spec)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class CellStatus(enum.Enum):
    """How a cell ended."""

    OK = "ok"  # ran to the end
    ERROR = "error"  # raised (including SyntaxError and MemoryError)
    TIMEOUT = "timeout"  # exceeded its time limit and was interrupted; the session lives
    INTERRUPTED = "interrupted"  # interrupted on request; the session lives
    KILLED = "killed"  # the sandbox died or was killed; the session is gone


@dataclass
class CellResult:
    """Everything a cell produced, in arrival order where order exists."""

    status: CellStatus = CellStatus.OK
    streams: list[tuple[str, str]] = field(default_factory=list)  # (stdout|stderr, text)
    result: dict[str, Any] | None = None  # {"data": {mime: value}, "json"?: value}
    displays: list[dict[str, Any]] = field(default_factory=list)  # mime bundles
    error: dict[str, Any] | None = None  # {"ename", "evalue", "traceback": [lines]}
    message: str | None = None  # what cloche says about a limit hit or a lost sandbox
    execution_count: int = 0
    duration_ms: float = 0.0
    dropped_bytes: int = 0  # output beyond the per-cell limit
    files: list[str] = field(default_factory=list)  # created or changed (when tracked)
    queue_wait_s: float = 0.0  # waited behind its session's earlier cells, then for its turn
    # Why a KILLED cell's sandbox died: "killed" (it ignored its interrupt), "memory" (the
    # memory cgroup's OOM killer), "sandbox_died" (anything else); see `end_reason`.
    killed_by: str = "sandbox_died"

    @property
    def end_reason(self) -> str:
        """The typed reason the cell ended (operations.md), finer than `status`: ok, error,
        timeout, interrupted, memory (MemoryError or the cgroup's OOM kill), output_limit,
        killed (ignored its interrupt), sandbox_died."""
        if self.status is CellStatus.KILLED:
            return self.killed_by
        if self.status is CellStatus.ERROR:
            return "memory" if self.error and self.error.get("ename") == "MemoryError" else "error"
        if self.status is not CellStatus.OK:
            return str(self.status.value)  # timeout, interrupted
        return "output_limit" if self.dropped_bytes else "ok"

    @property
    def session_survived(self) -> bool:
        return self.status is not CellStatus.KILLED

    def text(self, name: str) -> str:
        """All output of one stream."""
        return "".join(text for stream, text in self.streams if stream == name)

    @property
    def stdout(self) -> str:
        return self.text("stdout")

    @property
    def stderr(self) -> str:
        return self.text("stderr")

    @property
    def output(self) -> str:
        """stdout and stderr interleaved in arrival order."""
        return "".join(text for _, text in self.streams)

    @property
    def result_text(self) -> str | None:
        """The result's repr (text/plain), when there is a result."""
        if self.result is None:
            return None
        text = self.result["data"].get("text/plain")
        return text if isinstance(text, str) else None
