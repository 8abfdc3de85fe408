"""A session's cell history: its last cells, kept with the session (operations.md).

Each entry holds what a cell was and what it produced, cut to bounds: stdout and stderr
each to --history-output-bytes with a marker, images up to IMAGE_KEPT_BYTES (larger ones
named only), and the whole history to HISTORY_MAX_BYTES (the oldest entries go first).
The history is part of the session: written beside its image when it is paused,
snapshotted or moved (`HISTORY_FILE`), copied to a fork's copies.
"""

from __future__ import annotations

import functools
import json
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cloche.sessions.result import CellResult

HISTORY_FILE = "history.json"  # in a session's (or snapshot's) directory on disk
DEFAULT_HISTORY_CELLS = 200  # --history-cells
DEFAULT_HISTORY_OUTPUT_BYTES = 64 << 10  # --history-output-bytes
IMAGE_KEPT_BYTES = 1 << 20  # a display's image larger than this is named, not kept
HISTORY_MAX_BYTES = 32 << 20  # one session's history, at most (the oldest cells go first)
_IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/svg+xml")


@dataclass(frozen=True)
class CellEntry:
    """One cell as the history keeps it."""

    number: int  # its place in the session's life, from 1 (never reset, unlike the count)
    execution_count: int  # as the kernel counted it (a restart starts it again)
    code: str
    status: str  # ok, error, timeout, interrupted, killed
    end_reason: str  # finer (sessions.result.CellResult.end_reason)
    started_at: float  # unix time, s
    ended_at: float
    duration_s: float
    stdout: str
    stderr: str
    result: dict[str, Any] | None  # MIME bundle {mime: value} of the last expression
    displays: list[dict[str, Any]] = field(default_factory=list)  # MIME bundles
    error: dict[str, Any] | None = None  # {ename, evalue, traceback}
    files_changed: list[str] = field(default_factory=list)
    front_end: str = ""  # http, tcp, mcp, jupyter, ui, ...
    message: str | None = None  # what cloche said about it (a limit, a lost sandbox)
    kind: str = "cell"  # cell, command (a process: `code` is its command line), terminal
    exit_code: int | None = None  # a command's, when it exited on its own

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @functools.cached_property
    def size(self) -> int:
        """About how many bytes it holds, counted once (on every cell, as it is kept and
        again as it is let go): its texts' lengths, and its bundles' (their JSON's, where a
        value is not text), over a fixed share for the rest."""
        texts = (self.code, self.stdout, self.stderr, self.message or "", *self.files_changed)
        return (
            _ENTRY_BYTES
            + sum(len(text) for text in texts)
            + sum(_weight(part) for part in (self.result, self.error, *self.displays))
        )


_ENTRY_BYTES = 400  # an entry's JSON without its texts and bundles, about


def _weight(part: dict[str, Any] | None) -> int:
    """A bundle's (or an error's) size as JSON, about: text values by their length."""
    if not part:
        return 0
    if all(isinstance(value, str) for value in part.values()):
        return sum(len(key) + len(value) + 6 for key, value in part.items())
    return len(json.dumps(part, default=str))


def entry_of(
    result: CellResult,
    code: str,
    number: int,
    *,
    started_at: float,
    ended_at: float,
    front_end: str,
    output_bytes: int,
) -> CellEntry:
    """A finished cell's history entry, cut to the bounds."""
    return CellEntry(
        number=number,
        execution_count=result.execution_count,
        code=code,
        status=result.status.value,
        end_reason=result.end_reason,
        started_at=started_at,
        ended_at=ended_at,
        duration_s=round(ended_at - started_at, 6),
        stdout=cut(result.stdout, output_bytes),
        stderr=cut(result.stderr, output_bytes),
        result=_bundle(result.result["data"]) if result.result else None,
        displays=[_bundle(display) for display in result.displays],
        error=result.error,
        files_changed=list(result.files),
        front_end=front_end,
        message=result.message,
    )


class History:
    """A session's last cells, oldest first."""

    def __init__(self, max_cells: int, entries: Iterable[CellEntry] = ()) -> None:
        self._entries: deque[CellEntry] = deque(maxlen=max(max_cells, 0))
        self._bytes = 0
        self.last_number = 0
        for entry in entries:
            self.add(entry)

    def add(self, entry: CellEntry) -> None:
        self.last_number = max(self.last_number, entry.number)
        if self._entries.maxlen == 0:
            return
        if len(self._entries) == self._entries.maxlen:
            self._bytes -= self._entries[0].size
        self._entries.append(entry)
        self._bytes += entry.size
        while self._bytes > HISTORY_MAX_BYTES and len(self._entries) > 1:
            self._bytes -= self._entries.popleft().size

    def next_number(self) -> int:
        return self.last_number + 1

    def after(self, number: int = 0, limit: int | None = None) -> list[CellEntry]:
        """Entries after the one numbered number, oldest first, at most limit."""
        found = [e for e in self._entries if e.number > number]
        return found if limit is None else found[:limit]

    def get(self, number: int) -> CellEntry | None:
        return next((e for e in self._entries if e.number == number), None)

    @property
    def last(self) -> CellEntry | None:
        return self._entries[-1] if self._entries else None

    def copy(self) -> History:
        copied = History(self._entries.maxlen or 0, self._entries)
        copied.last_number = self.last_number
        return copied

    def __len__(self) -> int:
        return len(self._entries)

    # -- on disk --------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """Write it into a session's (or snapshot's) directory (blocking)."""
        data = {"last_number": self.last_number, "cells": [e.to_json() for e in self._entries]}
        path = directory / HISTORY_FILE
        partial = path.with_suffix(".part")
        partial.write_text(json.dumps(data))
        partial.chmod(0o600)
        partial.replace(path)

    @classmethod
    def load(cls, directory: Path, max_cells: int) -> History:
        """The history saved in a directory; an empty one if none is there or it can't be
        read (blocking)."""
        try:
            data = json.loads((directory / HISTORY_FILE).read_text())
            history = cls(max_cells, (CellEntry(**cell) for cell in data["cells"]))
            history.last_number = max(history.last_number, int(data["last_number"]))
        except (OSError, ValueError, TypeError, KeyError):
            return cls(max_cells)
        return history


def cut(text: str, limit: int) -> str:
    """text within limit bytes (UTF-8), with a marker saying how much was not kept."""
    data = text.encode()
    if len(data) <= limit:
        return text
    kept = data[:limit].decode(errors="ignore")
    return f"{kept}\n[cloche: {len(data) - limit} more bytes not kept in the history]"


def _bundle(data: dict[str, Any]) -> dict[str, Any]:
    """A MIME bundle with its images up to IMAGE_KEPT_BYTES; larger ones are named only."""
    kept: dict[str, Any] = {}
    for mime, value in data.items():
        size = len(value) if isinstance(value, str) else 0
        if mime in _IMAGE_TYPES and size > IMAGE_KEPT_BYTES:
            kept.setdefault(
                "text/plain",
                f"[cloche: a {mime} of {size} bytes, larger than the history keeps]",
            )
            continue
        kept[mime] = value
    return kept
