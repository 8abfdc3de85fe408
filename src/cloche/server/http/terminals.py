"""Terminals of a session over a websocket (`GET /v1/sessions/{id}/pty`).

Binary frames are the terminal's bytes, both ways; a text frame `{"resize": {"cols",
"rows"}}` resizes it. The shell is the template's, a login shell of the session's user
(or `?cmd=`, a command line run in the terminal). When the shell ends, a text frame
`{"exit": {"exit_code", "signal"}}` goes first and the socket closes (1000); when the
client closes the socket, the terminal is hung up (SIGHUP to its processes, SIGKILL to
what is left after a grace). A refusal closes the socket with 4000 + the HTTP status it
would have had (4404: no such session), its reason the message.

The inspector's page reaches the same bridge (`serve_terminal`) with its sign-in cookie.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import AsyncIterator

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from cloche.errors import ClocheError, ProcessNotFound, SessionNotFound, Unauthorized
from cloche.server.http.auth import bearer_owner
from cloche.server.http.errors import status_of
from cloche.sessions.commands import CommandSpec
from cloche.sessions.manager import SessionManager
from cloche.sessions.processes import Event, Exit, Output

log = logging.getLogger("cloche.http")
router = APIRouter()
MAX_COLS = 1000
MAX_ROWS = 1000


@router.websocket("/v1/sessions/{session_id}/pty")
async def terminal(
    websocket: WebSocket,
    session_id: str,
    cols: int = 80,
    rows: int = 24,
    cmd: str | None = None,
) -> None:
    try:
        owner = bearer_owner(websocket)
    except Unauthorized as exc:
        await refuse(websocket, exc)
        return
    manager: SessionManager = websocket.app.state.manager
    await serve_terminal(websocket, manager, session_id, owner, cols, rows, cmd, "pty")


async def refuse(websocket: WebSocket, exc: ClocheError) -> None:
    """Accept, then close with 4000 + the error's HTTP status and its message."""
    if websocket.client_state is WebSocketState.CONNECTING:
        await websocket.accept()
    code = 4000 + status_of(exc)[0]
    await websocket.close(code=code, reason=str(exc).encode()[:120].decode(errors="ignore"))


async def serve_terminal(
    websocket: WebSocket,
    manager: SessionManager,
    session_id: str,
    owner: str | None,
    cols: int,
    rows: int,
    cmd: str | None,
    front_end: str,
) -> None:
    """Open a terminal in the session and carry it over the websocket until either ends."""
    size = (max(1, min(cols, MAX_COLS)), max(1, min(rows, MAX_ROWS)))
    spec = CommandSpec(cmd=cmd or "", pty=size, stdin=True, timeout_s=0)
    try:
        pid, events = await manager.open_command(session_id, spec, owner=owner, front_end=front_end)
    except ClocheError as exc:
        await refuse(websocket, exc)
        return
    await websocket.accept()
    output = asyncio.create_task(_pump_out(websocket, events))
    try:
        await _pump_in(websocket, manager, session_id, pid, owner, output)
    finally:
        output.cancel()
        # A client gone mid-output fails the send (WebSocketDisconnect): the shell is hung
        # up all the same.
        with contextlib.suppress(asyncio.CancelledError, ClocheError, WebSocketDisconnect):
            await output
        if not output.done() or not _ended(output):
            with contextlib.suppress(ClocheError):
                await manager.hang_up(session_id, pid, owner)


def _ended(task: asyncio.Task[bool]) -> bool:
    return not task.cancelled() and task.exception() is None and task.result()


async def _pump_out(websocket: WebSocket, events: AsyncIterator[Event]) -> bool:
    """The terminal's bytes to the client; True when the shell ended (told, socket closed)."""
    try:
        async for event in events:
            if isinstance(event, Output):
                await websocket.send_bytes(event.data)
            elif isinstance(event, Exit):
                with contextlib.suppress(Exception):
                    end = {"exit_code": event.exit_code, "signal": _name(event.signal)}
                    await websocket.send_text(json.dumps({"exit": end}))
                    await websocket.close(code=1000)
                return True
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    return False


async def _pump_in(
    websocket: WebSocket,
    manager: SessionManager,
    session_id: str,
    pid: int,
    owner: str | None,
    output: asyncio.Task[bool],
) -> None:
    """The client's keystrokes and resizes to the terminal, until either side ends."""
    while not output.done():
        receive = asyncio.ensure_future(websocket.receive())
        await asyncio.wait([receive, output], return_when=asyncio.FIRST_COMPLETED)
        if not receive.done():
            receive.cancel()
            return
        message = receive.result()
        if message["type"] == "websocket.disconnect":
            return
        data, text = message.get("bytes"), message.get("text")
        try:
            if data:
                await manager.command_input(session_id, pid, data, owner=owner)
            elif text:
                await _control(manager, session_id, pid, owner, text)
        except (ProcessNotFound, SessionNotFound) as exc:  # ended meanwhile: the output tells
            log.debug("terminal %s of session %s: %s", pid, session_id, exc)
        except ClocheError as exc:  # not delivered (a supervisor that did not answer)
            log.warning("terminal %s of session %s: input or resize lost: %s", pid, session_id, exc)
        except WebSocketDisconnect:
            return


async def _control(
    manager: SessionManager, session_id: str, pid: int, owner: str | None, text: str
) -> None:
    try:
        message = json.loads(text)
        size = message["resize"]
        cols, rows = int(size["cols"]), int(size["rows"])
    except (ValueError, KeyError, TypeError):
        return  # not a control message of ours: ignored
    cols, rows = max(1, min(cols, MAX_COLS)), max(1, min(rows, MAX_ROWS))
    await manager.resize_terminal(session_id, pid, cols, rows, owner)


def _name(number: int | None) -> str | None:
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
