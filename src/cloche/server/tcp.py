"""The REPL TCP front end: 4-byte length + JSON frames, sessions by id (see the spec)."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from cloche.config import ServerConfig
from cloche.errors import (
    ClocheError,
    FrameTooLarge,
    IncompleteRead,
    InvalidMessage,
    SessionNotFound,
)
from cloche.protocol.framing import decode_body, encode_frame, read_body
from cloche.protocol.tcp import GREETING, Request, error_reply, parse_request
from cloche.server.metrics import Metrics
from cloche.server.tenants import Tenants
from cloche.sessions.manager import SessionManager
from cloche.sessions.result import CellResult, CellStatus

log = logging.getLogger("cloche.tcp")

_WRITE_TIMEOUT_S = 30.0  # a client that doesn't read its replies for this long is dropped


def render_reply(session_id: str, result: CellResult) -> dict[str, Any]:
    """The protocol's reply for a cell: output, then the echo of a final expression."""
    output = result.output
    if result.dropped_bytes:
        output += f"\n[cloche: {result.dropped_bytes} bytes of output dropped]\n"
    reply: dict[str, Any] = {"status": "ok", "output": output, "session_id": session_id}
    if result.status is CellStatus.OK:
        text = result.result_text
        if text is not None:
            reply["output"] = output + text + "\n"
    else:
        parts = []
        if result.error is not None:
            parts.append("\n".join(result.error["traceback"]))
        if result.message:
            parts.append(f"{result.status.value.capitalize()}: {result.message}")
        reply["status"] = "error"
        reply["error"] = "\n".join(parts) + "\n"
    reply["cell_status"] = result.status.value
    reply["session_alive"] = result.session_survived
    return reply


class TCPFrontEnd:
    """Serves the REPL protocol; any connection may use any session of its token."""

    def __init__(
        self,
        manager: SessionManager,
        config: ServerConfig,
        metrics: Metrics | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        self.manager = manager
        self.config = config
        self.tenants = tenants or Tenants.load(
            config.tokens_file, config.tokens, config.admin_tokens
        )
        self.metrics = metrics or Metrics()
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(
            self._serve, self.config.host, self.config.tcp_port, limit=1 << 20, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """Stop accepting, and drop open connections."""
        self.stop_accepting()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if len(self._connections) > self.config.max_connections:
                self._rejected("max_connections")
                await self._send(
                    writer,
                    error_reply(
                        f"the server is at its limit of {self.config.max_connections} connections; "
                        "retry later"
                    ),
                )
                return
            await self._send(writer, GREETING)
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, TimeoutError, IncompleteRead):
            pass
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("connection failed")
        finally:
            self._connections.discard(task)
            writer.close()

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Serve one request; False when the connection should close."""
        try:
            async with asyncio.timeout(self.config.connection_idle_timeout_s):
                body = await read_body(reader, self.config.max_frame_bytes)
        except FrameTooLarge as exc:
            self._rejected("too_large")
            await self._send(
                writer,
                error_reply(
                    f"Frame too large: {exc.length} bytes declared, the limit is "
                    f"{exc.limit} bytes (--max-frame-bytes); closing the connection"
                ),
            )
            return False
        if body is None:
            return False
        try:
            request = parse_request(decode_body(body))
        except InvalidMessage as exc:
            self._rejected("invalid")
            await self._send(writer, error_reply(str(exc)))
            return True
        await self._send(writer, await self._run(request))
        return True

    async def _run(self, request: Request) -> dict[str, Any]:
        caller = self.tenants.caller(request.token)
        if caller is None:
            self._rejected("unauthorized")
            return error_reply("Unauthorized: this server needs a valid 'token' in each request")
        owner = caller.token
        try:
            if request.session_id is None:
                session_id, result = await self.manager.create_and_execute(
                    request.code,
                    owner=owner,
                    timeout_s=request.timeout_s,
                    profile=request.profile,
                    template=request.template,
                    front_end="tcp",
                )
            else:
                session_id = request.session_id
                result = await self.manager.execute(
                    session_id,
                    request.code,
                    owner=owner,
                    timeout_s=request.timeout_s,
                    front_end="tcp",
                )
        except SessionNotFound as exc:
            self._rejected("not_found")
            return error_reply(f"Session {exc.session_id} not found")
        except ClocheError as exc:
            self._rejected(type(exc).__name__)
            extra = {"session_id": request.session_id} if request.session_id else {}
            return error_reply(str(exc), **extra)
        return render_reply(session_id, result)

    def _rejected(self, reason: str) -> None:
        self.metrics.rejected.labels("tcp", reason).inc()

    async def _send(self, writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
        writer.write(encode_frame(message))
        if writer.transport.get_write_buffer_size():  # the client is behind on reading
            async with asyncio.timeout(_WRITE_TIMEOUT_S):
                await writer.drain()
