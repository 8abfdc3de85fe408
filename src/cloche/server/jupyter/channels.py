"""`/api/kernels/{id}/channels`: a kernel's messages over one websocket.

Jupyter's legacy JSON framing only: the `v1.kernel.websocket.jupyter.org` subprotocol is
declined, and clients fall back to it. A frame that is not JSON closes that connection
(1003); one over --max-frame-bytes is refused by the websocket layer (1009). Neither ends
the kernel, and neither does a connection that closes, even in the middle of a cell.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, WebSocket

from cloche.errors import ClocheError
from cloche.server.http.auth import gateway_owner
from cloche.server.http.errors import error_response, status_of
from cloche.server.jupyter.connection import DRAIN_TIMEOUT_S, Connection
from cloche.server.jupyter.kernels import Gateway
from cloche.server.jupyter.messages import NotAMessage, Request, parse
from cloche.server.metrics import Metrics

log = logging.getLogger("cloche.jupyter")

UNSUPPORTED_DATA = 1003  # the websocket close code for a frame that is not a message
PARSE_IN_THREAD_CHARS = 1 << 20  # frames longer than this are parsed off the event loop
router = APIRouter()


@router.websocket("/api/kernels/{kernel_id}/channels")
async def channels(websocket: WebSocket, kernel_id: str) -> None:
    gateway: Gateway = websocket.app.state.jupyter
    metrics: Metrics = websocket.app.state.metrics
    try:
        owner = gateway_owner(websocket)
        await gateway.manager.info(kernel_id, owner)
    except ClocheError as exc:
        await _refuse(websocket, exc)
        return
    await websocket.accept()  # with no subprotocol: the client falls back to JSON frames
    connection = Connection(websocket)
    kernel = gateway.attach(kernel_id, owner, connection)
    metrics.jupyter_connections.inc()
    pump = asyncio.create_task(connection.pump())
    try:
        while True:
            event = await websocket.receive()
            if event["type"] == "websocket.disconnect":
                break
            try:
                request = await _request(event.get("text"), event.get("bytes"))
            except NotAMessage as exc:
                log.info("kernel %s: connection closed: %s", kernel_id, exc)
                connection.close(UNSUPPORTED_DATA, str(exc))
                break
            if request is None:
                log.info("kernel %s: a message without msg_type ignored", kernel_id)
                continue
            kernel.receive(connection, request)
    finally:
        gateway.detach(kernel, connection)
        connection.close()
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                await pump
        except TimeoutError:
            log.info("kernel %s: a connection's last messages were not taken", kernel_id)
        finally:
            metrics.jupyter_connections.dec()


async def _request(text: str | None, data: bytes | None) -> Request | None:
    if len(text or data or "") > PARSE_IN_THREAD_CHARS:
        return await asyncio.to_thread(parse, text, data)
    return parse(text, data)


async def _refuse(websocket: WebSocket, exc: ClocheError) -> None:
    """Answer the handshake with the error's status (401, 404, ...) when the server can,
    else close it (which uvicorn answers 403)."""
    status, kind = status_of(exc)
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(error_response(status, kind, str(exc)))
    else:
        await websocket.close(1008, str(exc)[:120])
