"""Kernels as the gateway sees them: a session, its open websockets, its shell requests.

Shell requests of a kernel are answered one at a time, in the order they came (from any of
its connections), as a Jupyter kernel does; control requests (interrupt, shutdown) at once.
iopub goes to every open connection of the kernel, a reply to the connection that asked.
A kernel is held here only while it has connections or requests: the session is the state.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from cloche.errors import ClocheError
from cloche.server.jupyter import replies
from cloche.server.jupyter.connection import Connection
from cloche.server.jupyter.messages import Request, message, session_of
from cloche.sessions import introspection
from cloche.sessions.manager import SessionManager
from cloche.sessions.result import CellResult, CellStatus
from cloche.sessions.session import SessionInfo

log = logging.getLogger("cloche.jupyter")

Content = dict[str, Any]
IGNORED = frozenset({"comm_open", "comm_msg", "comm_close"})  # comms: none here
CLOSED_REASON = "the kernel was shut down"
# A cell's first messages (status busy, execute_input) wait this long for its output or its
# end, so that a short cell's four messages reach the client in one write: a syscall less
# on each side per cell (BENCHMARKS.md, 100 busy kernels). Output, an input() prompt or the
# end of the cell sends them at once.
START_HOLD_S = 0.005
ABORTED: Content = {
    "status": "aborted",
    "execution_count": None,
    "user_expressions": {},
    "payload": [],
}


class GatewayKernel:
    """One session with websockets open to it, or shell requests in flight."""

    def __init__(self, gateway: Gateway, kernel_id: str, owner: str | None) -> None:
        self.gateway = gateway
        self.id = kernel_id
        self.owner = owner
        self.connections: set[Connection] = set()
        # The session's execution count after the last cell run here (asked when unknown):
        # what execute_input announces for the next cell without one more call per cell.
        self.count: int | None = None
        self._shell: collections.deque[tuple[Connection, Request]] = collections.deque()
        self._worker: asyncio.Task[None] | None = None
        self._shell_handlers: dict[str, Callable[[Request], Awaitable[Content]]] = {
            "kernel_info_request": self._kernel_info,
            "is_complete_request": self._is_complete,
            "comm_info_request": self._comm_info,
            "complete_request": self._complete,
            "inspect_request": self._inspect,
            "history_request": self._history,
        }

    @property
    def session(self) -> str:
        """`header.session` of what the kernel sends: new after each restart."""
        return session_of(self.id, self.gateway.restarts.get(self.id, 0))

    @property
    def busy(self) -> bool:
        """Whether shell requests are being answered."""
        return self._worker is not None

    # -- sending ----------------------------------------------------------------------------

    def iopub(self, msg_type: str, content: Content, parent: Request) -> None:
        """Broadcast to every open connection of the kernel."""
        sent = message("iopub", msg_type, content, parent, self.session)
        for connection in list(self.connections):
            connection.send(sent)

    def reply(self, connection: Connection, parent: Request, content: Content) -> None:
        """The answer to a request, on its channel, to the connection that asked."""
        msg_type = parent.msg_type.removesuffix("_request") + "_reply"
        connection.send(message(parent.channel, msg_type, content, parent, self.session))

    def _status(self, state: str, parent: Request) -> None:
        self.iopub("status", {"execution_state": state}, parent)

    # -- receiving --------------------------------------------------------------------------

    def receive(self, connection: Connection, request: Request) -> None:
        """Take a request from a connection: control at once, shell in turn."""
        if request.msg_type in IGNORED:
            return
        if request.msg_type == "input_reply":  # the value for a cell's input(), on stdin
            value = request.content.get("value")
            answer = self.gateway.manager.answer_input(
                self.id, value if isinstance(value, str) else "", self.owner
            )
            self.gateway.spawn(_quietly(answer))
            return
        if request.channel == "control":
            self.gateway.spawn(self._control(connection, request))
        elif request.channel == "shell":
            self._shell.append((connection, request))
            if self._worker is None:
                self._worker = self.gateway.spawn(self._work())
        else:
            log.info("kernel %s: %s on %s ignored", self.id, request.msg_type, request.channel)

    async def _work(self) -> None:
        try:
            while self._shell:
                connection, request = self._shell.popleft()
                try:
                    await self._shell_request(connection, request)
                except Exception:
                    log.exception("kernel %s: %s failed", self.id, request.msg_type)
        finally:
            self._worker = None
            self.gateway.release(self)

    async def _shell_request(self, connection: Connection, request: Request) -> None:
        if request.msg_type == "execute_request":
            held = list(self.connections)
            for each in held:
                each.hold()
            timer = asyncio.get_running_loop().call_later(START_HOLD_S, _release, held)
            self._status("busy", request)
            try:
                content = await self._execute(connection, request, held)
                self.reply(connection, request, content)
            finally:
                timer.cancel()
                _release(held)
                self._status("idle", request)
            if content["status"] == "error" and request.content.get("stop_on_error") is not False:
                self._abort_queued()
            return
        handler = self._shell_handlers.get(request.msg_type)
        if handler is None:
            log.warning("kernel %s: unknown message %r not answered", self.id, request.msg_type)
            return
        self._status("busy", request)
        try:
            self.reply(connection, request, await handler(request))
        finally:
            self._status("idle", request)

    def _abort_queued(self) -> None:
        """Answer the execute requests waiting behind a failed one `aborted` (as ipykernel
        does with stop_on_error); other requests keep their turn."""
        waiting = list(self._shell)
        self._shell.clear()
        for connection, request in waiting:
            if request.msg_type != "execute_request":
                self._shell.append((connection, request))
                continue
            self._status("busy", request)
            self.reply(connection, request, ABORTED)
            self._status("idle", request)

    # -- shell requests -----------------------------------------------------------------------

    async def _kernel_info(self, request: Request) -> Content:
        return replies.kernel_info()

    async def _is_complete(self, request: Request) -> Content:
        code = request.content.get("code")
        return replies.is_complete(code if isinstance(code, str) else "")

    async def _comm_info(self, request: Request) -> Content:
        return {"status": "ok", "comms": {}}

    async def _complete(self, request: Request) -> Content:
        code, cursor = _code_and_cursor(request.content)
        try:
            found = await introspection.complete(
                self.gateway.manager, self.id, code, cursor, self.owner
            )
        except ClocheError as exc:
            return {"status": "error", "ename": type(exc).__name__, "evalue": str(exc)}
        return {"status": "ok", **found, "metadata": {}}

    async def _inspect(self, request: Request) -> Content:
        code, cursor = _code_and_cursor(request.content)
        detail = 1 if request.content.get("detail_level") == 1 else 0
        try:
            text = await introspection.inspect(
                self.gateway.manager, self.id, code, cursor, detail, self.owner
            )
        except ClocheError as exc:
            return {"status": "error", "ename": type(exc).__name__, "evalue": str(exc)}
        data = {"text/plain": text} if text is not None else {}
        return {"status": "ok", "found": text is not None, "data": data, "metadata": {}}

    async def _history(self, request: Request) -> Content:
        """From the session's history, with the cells of every front end (`replies.history`)."""
        try:
            cells = await self.gateway.manager.history(self.id, self.owner)
        except ClocheError as exc:
            return {"status": "error", "ename": type(exc).__name__, "evalue": str(exc)}
        return {"status": "ok", "history": replies.history(cells, request.content)}

    async def _execute(
        self, connection: Connection, request: Request, held: list[Connection]
    ) -> Content:
        """Run the cell, its output on iopub as it happens (what is held goes first); the
        content of execute_reply."""
        content = request.content
        code = content.get("code")
        code = code if isinstance(code, str) else ""
        silent = content.get("silent") is True  # runs, counted, but nothing is broadcast
        manager = self.gateway.manager
        try:
            if self.count is None:
                self.count = (await manager.info(self.id, self.owner)).execution_count
        except ClocheError as exc:
            return self._refused(request, exc, 0, silent)
        count = self.count + 1
        if not silent:
            self.iopub("execute_input", {"code": code, "execution_count": count}, request)

        pages: list[Content] = []  # `obj?`: IPython's page payloads, in execute_reply

        def on_event(event: dict[str, Any]) -> None:
            _release(held)
            kind = event.get("type")
            if kind == "page":
                text = event.get("text", "")
                pages.append({"source": "page", "data": {"text/plain": text}, "start": 0})
            elif kind in ("stdout", "stderr"):
                self.iopub("stream", {"name": kind, "text": event.get("text", "")}, request)
            elif kind == "display":
                bundle = {"data": event.get("data", {}), "metadata": {}, "transient": {}}
                self.iopub("display_data", bundle, request)
            elif kind == "input_request":  # to the connection that allowed it, on stdin
                asked = {"prompt": event.get("prompt", ""), "password": event.get("password")}
                connection.send(message("stdin", "input_request", asked, request, self.session))

        try:
            result = await manager.execute(
                self.id,
                code,
                owner=self.owner,
                timeout_s=self.gateway.timeouts.get(self.id),
                on_event=None if silent else on_event,
                stdin=content.get("allow_stdin") is True and not silent,
                pager=True,
                front_end="jupyter",
            )
        except ClocheError as exc:
            self.count = None
            return self._refused(request, exc, count, silent)
        self.count = result.execution_count if result.execution_count else None
        reply = self._outcome(request, result, silent)
        if pages and reply["status"] == "ok":
            reply["payload"] = pages
        return reply

    def _outcome(self, request: Request, result: CellResult, silent: bool) -> Content:
        count = result.execution_count
        reply: Content = {
            "status": "ok",
            "execution_count": count,
            "user_expressions": {},
            "payload": [],
        }
        if result.status is CellStatus.OK:
            if not silent and result.message:  # output over the limit was dropped
                self.iopub("stream", {"name": "stderr", "text": f"{result.message}\n"}, request)
            if not silent and result.result is not None:
                executed = {"data": result.result["data"], "metadata": {}, "execution_count": count}
                self.iopub("execute_result", executed, request)
            return reply
        error = dict(result.error) if result.error is not None else {}
        if result.status in (CellStatus.TIMEOUT, CellStatus.INTERRUPTED):
            error.setdefault("ename", "KeyboardInterrupt")
        error.setdefault("ename", "KernelDied" if result.status is CellStatus.KILLED else "Error")
        error.setdefault("evalue", result.message or "")
        traceback = list(error.get("traceback") or [])
        if result.message and result.message != error["evalue"]:
            traceback.append(result.message)
        error["traceback"] = traceback
        if not silent:
            self.iopub("error", error, request)
        return {**reply, "status": "error", **error}

    def _refused(self, request: Request, exc: ClocheError, count: int, silent: bool) -> Content:
        """The reply to a cell the session would not run (gone, or its queue full)."""
        error = {"ename": type(exc).__name__, "evalue": str(exc), "traceback": [str(exc)]}
        if not silent:
            self.iopub("error", error, request)
        return {
            "status": "error",
            "execution_count": count,
            "user_expressions": {},
            "payload": [],
            **error,
        }

    # -- control requests ---------------------------------------------------------------------

    async def _control(self, connection: Connection, request: Request) -> None:
        manager = self.gateway.manager
        if request.msg_type == "interrupt_request":
            try:
                await manager.interrupt(self.id, self.owner)
                content: Content = {"status": "ok"}
            except ClocheError as exc:
                content = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc)}
            self.reply(connection, request, content)
        elif request.msg_type == "shutdown_request":
            await self._shutdown(connection, request)
        elif request.msg_type == "kernel_info_request":
            self.reply(connection, request, replies.kernel_info())
        else:
            log.warning(
                "kernel %s: unknown control message %r not answered", self.id, request.msg_type
            )

    async def _shutdown(self, connection: Connection, request: Request) -> None:
        if request.content.get("restart") is True:
            try:
                await self.gateway.restart(self.id, self.owner)
                content: Content = {"status": "ok", "restart": True}
            except ClocheError as exc:
                content = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc)}
                content["restart"] = True
            self.reply(connection, request, content)
            return
        try:
            await self.gateway.manager.close(self.id, self.owner, reason="deleted")
        except ClocheError as exc:
            content = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc)}
            self.reply(connection, request, {**content, "restart": False})
            return
        self.reply(connection, request, {"status": "ok", "restart": False})
        self.iopub("shutdown_reply", {"status": "ok", "restart": False}, request)
        self.gateway.closed(self.id)


def _release(connections: list[Connection]) -> None:
    for connection in connections:
        connection.release()


def _code_and_cursor(content: Content) -> tuple[str, int]:
    """The code of a complete or inspect request, and the cursor (its end when absent)."""
    code = content.get("code")
    code = code if isinstance(code, str) else ""
    cursor = content.get("cursor_pos")
    return code, cursor if isinstance(cursor, int) and 0 <= cursor <= len(code) else len(code)


async def _quietly(answer: Awaitable[bool]) -> None:
    """An input_reply for a session that is gone, or has no input() waiting: dropped."""
    try:
        await answer
    except ClocheError:
        pass


class Gateway:
    """The kernels with connections or requests in flight, over a session manager."""

    def __init__(
        self,
        manager: SessionManager,
        timeouts: dict[str, float],
        background: set[asyncio.Task[None]],
    ) -> None:
        self.manager = manager
        self.timeouts = timeouts  # cell time limits per session (the sessions API's)
        self.background = background  # tasks the HTTP front end waits for at shutdown
        self.kernels: dict[str, GatewayKernel] = {}
        self.restarts: dict[str, int] = {}  # by kernel id: each restart is a new session

    async def restart(self, kernel_id: str, owner: str | None) -> SessionInfo:
        """A fresh interpreter, same kernel id; what is sent afterwards has a new
        `header.session`. Its connections see iopub `restarting`, then `idle`.

        Raises:
            SessionNotFound: unknown, or another owner's.
        """
        info = await self.manager.restart(kernel_id, owner)
        self.restarts[kernel_id] = self.restarts.get(kernel_id, 0) + 1
        kernel = self.kernels.get(kernel_id)
        if kernel is not None:
            kernel.count = 0
            parent = Request("control", "shutdown_request", {}, {})
            for state in ("restarting", "idle"):
                kernel.iopub("status", {"execution_state": state}, parent)
        return info

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coroutine)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def attach(self, kernel_id: str, owner: str | None, connection: Connection) -> GatewayKernel:
        kernel = self.kernels.get(kernel_id)
        if kernel is None:
            kernel = self.kernels[kernel_id] = GatewayKernel(self, kernel_id, owner)
        kernel.connections.add(connection)
        return kernel

    def detach(self, kernel: GatewayKernel, connection: Connection) -> None:
        kernel.connections.discard(connection)
        self.release(kernel)

    def release(self, kernel: GatewayKernel) -> None:
        """Forget a kernel that has no connection and no request left."""
        if not kernel.connections and not kernel.busy and self.kernels.get(kernel.id) is kernel:
            del self.kernels[kernel.id]

    def connections(self, kernel_id: str) -> int:
        kernel = self.kernels.get(kernel_id)
        return len(kernel.connections) if kernel is not None else 0

    def busy(self, kernel_id: str) -> bool:
        kernel = self.kernels.get(kernel_id)
        return kernel is not None and kernel.busy

    def closed(self, kernel_id: str) -> None:
        """The kernel's session was closed: close its connections."""
        kernel = self.kernels.get(kernel_id)
        if kernel is not None:
            for connection in list(kernel.connections):
                connection.close(1000, CLOSED_REASON)
