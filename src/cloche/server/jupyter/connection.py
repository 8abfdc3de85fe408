"""One client's websocket to a kernel, written in order by a task of its own."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from cloche.server.jupyter.messages import frame

log = logging.getLogger("cloche.jupyter")

DRAIN_TIMEOUT_S = 10.0  # a closing connection's last messages wait this long for the client
_MAX_REASON_BYTES = 123  # the most a close frame's reason may hold


class Connection:
    """Messages for one websocket: queued by whoever sends them (an output callback may not
    wait), written by `pump`, in the order queued."""

    def __init__(self, websocket: WebSocket) -> None:
        self.websocket = websocket
        self.open = True  # False once its end is queued: nothing more is sent
        self._outbox: asyncio.Queue[str | tuple[int, str]] = asyncio.Queue()
        self._held: list[str] | None = None  # messages held back while a short cell runs

    def send(self, message: dict[str, Any]) -> None:
        if not self.open:
            return
        if self._held is not None:
            self._held.append(frame(message))
        else:
            self._outbox.put_nowait(frame(message))

    def hold(self) -> None:
        """Keep what is sent from now on until release(), in order."""
        if self._held is None:
            self._held = []

    def release(self) -> None:
        """Queue what was held (and stop holding)."""
        held, self._held = self._held, None
        for text in held or ():
            self._outbox.put_nowait(text)

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Close after what is already queued (idempotent: the first close's code counts)."""
        self.release()
        if self.open:
            self.open = False
            reason = reason.encode()[:_MAX_REASON_BYTES].decode("utf-8", "ignore")
            self._outbox.put_nowait((code, reason))

    async def pump(self) -> None:
        """Write the queued messages until the connection is closed or gone."""
        try:
            while True:
                item = await self._outbox.get()
                if isinstance(item, tuple):
                    code, reason = item
                    await self.websocket.close(code, reason)
                    return
                await self.websocket.send_text(item)
        except (OSError, RuntimeError, WebSocketDisconnect) as exc:  # the client went away
            log.debug("websocket send failed: %s", exc)
        finally:
            self.open = False
