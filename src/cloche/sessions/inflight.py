"""The cell in flight on a kernel's channel: its stage, its clock, and what has arrived.

What the kernel sends about a cell is bounded here: output beyond the cell's limit is
dropped (and counted), and far beyond it is a flood that costs the kernel its sandbox.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from itertools import groupby
from operator import itemgetter
from typing import Any

from cloche.config import MIB
from cloche.errors import InvalidMessage
from cloche.sessions.messages import parse_error, parse_mime_bundle, parse_number, parse_result
from cloche.sessions.result import CellResult, CellStatus

log = logging.getLogger("cloche.kernel")

# Output a kernel may send beyond a cell's limit before it counts as a flood (its own
# kernel caps output, so only a hostile one gets near this).
_FLOOD_FACTOR = 4


class Stage(enum.Enum):
    RUNNING = "running"
    INTERRUPTING = "interrupting"  # SIGINT sent; waiting for the grace period
    KILLING = "killing"  # grace is over; the sandbox is being killed


class Cell:
    """The cell in flight and what has arrived for it."""

    def __init__(
        self,
        timeout_s: float,
        limit_chars: int,
        on_event: Callable[[dict[str, Any]], None] | None,
        stdin: bool = False,
    ) -> None:
        self.timeout_s = timeout_s
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.result = CellResult()
        self.limit_chars = limit_chars
        self.kept_chars = 0
        self.received_chars = 0
        self.on_event = on_event
        self.stage = Stage.RUNNING
        self.reason: CellStatus | None = None  # TIMEOUT or INTERRUPTED once signalled
        self.timer: asyncio.TimerHandle | None = None
        self.held_s: float | None = None  # time left on its clock while it waits for an LLM
        self.stdin = stdin  # its client answers input() (on_event gets "input_request")
        self.asking: int | None = None  # the id of the kernel's input request awaiting a value

    def emit(self, event: dict[str, Any]) -> None:
        """Tell the cell's listener, if it has one."""
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a front end's listener must not break the channel
                log.exception("event listener failed")

    def ask(self, request_id: int, prompt: str, password: bool) -> bool:
        """The cell's input() asks its client for a value; False when none can answer now."""
        if not self.stdin or self.asking is not None or self.stage is not Stage.RUNNING:
            return False
        self.asking = request_id
        self.emit({"type": "input_request", "prompt": prompt, "password": password})
        return True

    def stream(self, name: str, text: str) -> None:
        """Output on stdout or stderr: kept within the cell's limit, the rest counted."""
        self.received_chars += len(text)
        if self.received_chars > self.limit_chars * _FLOOD_FACTOR + MIB:
            raise InvalidMessage(f"output flood ({self.received_chars} characters in one cell)")
        room = self.limit_chars - self.kept_chars
        if len(text) > room:
            self.result.dropped_bytes += len(text) - max(room, 0)
            text = text[: max(room, 0)]
        if not text:
            return
        self.kept_chars += len(text)
        self.result.streams.append((name, text))  # runs of one stream joined at the end
        self.emit({"type": name, "text": text})

    def display(self, data: Any) -> None:
        """A display (`display(obj)`, a figure), unless the cell is being killed."""
        if self.stage is not Stage.KILLING:
            bundle = parse_mime_bundle(data)
            self.result.displays.append(bundle)
            self.emit({"type": "display", "data": bundle})

    def page(self, text: Any) -> None:
        """What `obj?` shows, for a Jupyter client's pager, unless the cell is being killed."""
        if self.stage is not Stage.KILLING and isinstance(text, str):
            self.emit({"type": "page", "text": text[: self.limit_chars]})

    def end(self, message: dict[str, Any], memory_mib: int) -> None:
        """The kernel's end of the cell (`done`), made its result."""
        result = self.result
        result.streams = _joined(result.streams)
        status = message.get("status")
        if status not in ("ok", "error"):
            raise InvalidMessage("malformed end of cell")
        result.error = parse_error(message.get("error")) if status == "error" else None
        result.result = parse_result(message.get("result")) if status == "ok" else None
        result.execution_count = parse_number(message.get("execution_count"), int)
        result.duration_ms = parse_number(message.get("duration_ms"), float)
        result.dropped_bytes += parse_number(message.get("dropped_bytes"), int)
        result.status = CellStatus.ERROR if status == "error" else CellStatus.OK
        if result.error is not None:
            ename = result.error["ename"]
            if ename == "KeyboardInterrupt" and self.reason is not None:
                result.status = self.reason
                result.message = _interrupt_message(self.reason, self.timeout_s)
            elif ename == "MemoryError":
                result.message = (
                    f"MemoryError: the cell hit the memory limit of {memory_mib} MiB "
                    "(--memory-mib); the session survived"
                )

    def gone(self, death: str, killed_by: str) -> None:
        """The cell ends KILLED: its kernel is gone (`death` says why)."""
        self.result.streams = _joined(self.result.streams)
        self.result.status = CellStatus.KILLED
        self.result.message = f"{death}; the session is gone"
        self.result.killed_by = killed_by

    def tell_truncation(self) -> None:
        """Say in the result's message how much output went over the limit, if any did."""
        if self.result.dropped_bytes:
            self.result.message = _join(
                self.result.message,
                f"output truncated: {self.result.dropped_bytes} bytes beyond the limit of "
                f"{self.limit_chars} bytes per cell were dropped (--output-limit)",
            )


def _joined(streams: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Runs of one stream's chunks as one text each, in one pass at the end of the cell
    (appending each chunk to one string copied it whole every time: quadratic in the
    number of chunks, on the event loop)."""
    return [
        (name, "".join(text for _, text in run)) for name, run in groupby(streams, itemgetter(0))
    ]


def _join(first: str | None, second: str) -> str:
    return f"{first}; {second}" if first else second


def _interrupt_message(reason: CellStatus, timeout_s: float) -> str:
    if reason is CellStatus.TIMEOUT:
        return (
            f"the cell exceeded its time limit of {timeout_s:g} s (--cell-timeout) "
            "and was interrupted; the session survived"
        )
    return "the cell was interrupted; the session survived"
