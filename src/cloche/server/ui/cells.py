"""Cells run from the inspector, and a session's history as its page shows it.

A cell run from the page runs in a task of its own, so the page answers at once and can
interrupt it; while it runs, its output so far is kept here and shown after the session's
history (the manager's, which has it once it ended).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from cloche.errors import ClocheError
from cloche.server.ui.outputs import CellView, cell_view
from cloche.sessions.manager import SessionManager

log = logging.getLogger("cloche.ui")
FRONT_END = "ui"  # what the history says the inspector's cells came from


@dataclass
class Running:
    """A cell run from the page that has not ended yet."""

    code: str
    started_at: float  # unix time, s
    streams: dict[str, list[str]] = field(default_factory=lambda: {"stdout": [], "stderr": []})
    displays: list[dict[str, Any]] = field(default_factory=list)
    size: int = 0  # events seen: the page's version changes with it

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind in ("stdout", "stderr"):
            self.streams[str(kind)].append(str(event.get("text", "")))
        elif kind == "display" and isinstance(event.get("data"), dict):
            self.displays.append(event["data"])
        self.size += 1

    def entry(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "status": "running",
            "started_at": self.started_at,
            "stdout": "".join(self.streams["stdout"]),
            "stderr": "".join(self.streams["stderr"]),
            "displays": self.displays,
        }


class Cells:
    """The cells the inspector started, by session."""

    def __init__(self, background: set[asyncio.Task[Any]]) -> None:
        self._background = background  # the HTTP front end waits for these when it stops
        self._running: dict[str, list[Running]] = {}

    def run(
        self,
        manager: SessionManager,
        session_id: str,
        code: str,
        owner: str | None,
        timeout_s: float | None,
    ) -> asyncio.Task[ClocheError | None]:
        """Start a cell in the background; its task ends with the error that refused the
        cell (a full queue, a session gone), or None once it ran."""
        running = Running(code, time.time())
        self._running.setdefault(session_id, []).append(running)

        async def execute() -> ClocheError | None:
            try:
                await manager.execute(
                    session_id,
                    code,
                    owner=owner,
                    timeout_s=timeout_s,
                    on_event=running.on_event,
                    track_files=True,
                    front_end=FRONT_END,
                )
            except ClocheError as exc:  # refused (busy, gone): the page says so, if it waits
                log.info("a cell from the inspector was refused: %s", exc)
                return exc
            finally:
                cells = self._running.get(session_id, [])
                if running in cells:
                    cells.remove(running)
                if not cells:
                    self._running.pop(session_id, None)
            return None

        task = asyncio.create_task(execute(), name=f"cloche-ui-cell-{session_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def running(self, session_id: str) -> list[Running]:
        return list(self._running.get(session_id, ()))

    def version(self, session_id: str) -> str:
        """Changes whenever a running cell of the page's has more to show."""
        return ",".join(str(r.size) for r in self._running.get(session_id, ()))

    async def history(
        self, manager: SessionManager, session_id: str, owner: str | None
    ) -> list[CellView]:
        """The session's cells, oldest first, then the page's cells still running.

        Raises:
            SessionNotFound: unknown id, or another owner's session.
        """
        entries = await manager.history(session_id, owner, after=0, limit=None)
        views = [cell_view(entry.to_json()) for entry in entries]
        views.extend(cell_view(r.entry(), running=True) for r in self.running(session_id))
        return views
