"""A session's commands and terminals over a cluster: the process verbs of a front end.

The front end (`ClusterCommands`, a layer of the cluster's manager) sends each verb to the
node that holds the session; the node's agent (`cluster/command_requests.py`) does it with
its own manager. A foreground run's output and a watched process's events
travel as the request's events (`codec.event_out`); a listener that goes away cancels its
request, which ends the run (the command killed) or the watch (the process goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from cloche.cluster import codec
from cloche.cluster.link import LinkDown
from cloche.cluster.members import node_failed
from cloche.cluster.routing import SessionRouting
from cloche.errors import ProcessError
from cloche.sessions.commands import CommandResult, CommandSpec, EventSink
from cloche.sessions.processes import Event, Exit


class ClusterCommands(SessionRouting):
    """The process verbs of the cluster's manager, sent to each session's node."""

    async def run_command(
        self,
        session_id: str,
        spec: CommandSpec,
        *,
        owner: str | None = None,
        on_event: EventSink | None = None,
        front_end: str = "",
    ) -> CommandResult:
        def events(raw: dict[str, Any]) -> None:
            if on_event is not None:
                on_event(codec.run_event_in(raw))

        args = {"spec": codec.spec_out(spec), "owner": owner, "front_end": front_end}
        raw = await self._call(session_id, "run_command", args, events)
        return codec.command_result_in(raw)

    async def start_command(
        self, session_id: str, spec: CommandSpec, *, owner: str | None = None, front_end: str = ""
    ) -> int:
        args = {"spec": codec.spec_out(spec), "owner": owner, "front_end": front_end}
        pid: int = await self._call(session_id, "start_command", args)
        return pid

    async def open_command(
        self, session_id: str, spec: CommandSpec, *, owner: str | None = None, front_end: str = ""
    ) -> tuple[int, AsyncIterator[Event]]:
        args = {"spec": codec.spec_out(spec), "owner": owner, "front_end": front_end}
        return await self._listen(session_id, "open_command", args)

    async def commands(self, session_id: str, owner: str | None = None) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = await self._call(session_id, "commands", {"owner": owner})
        return found

    async def watch_command(
        self, session_id: str, pid: int, owner: str | None = None
    ) -> AsyncIterator[Event]:
        _, events = await self._listen(session_id, "watch_command", {"pid": pid, "owner": owner})
        return events

    async def command_input(
        self, session_id: str, pid: int, data: bytes, *, eof: bool = False, owner: str | None = None
    ) -> None:
        args = {"pid": pid, "data": codec.bytes_out(data), "eof": eof, "owner": owner}
        await self._call(session_id, "command_input", args)

    async def signal_command(
        self, session_id: str, pid: int, number: int, owner: str | None = None
    ) -> None:
        args = {"pid": pid, "number": number, "owner": owner}
        await self._call(session_id, "signal_command", args)

    async def kill_command(self, session_id: str, pid: int, owner: str | None = None) -> None:
        await self._call(session_id, "kill_command", {"pid": pid, "owner": owner})

    async def resize_terminal(
        self, session_id: str, pid: int, cols: int, rows: int, owner: str | None = None
    ) -> None:
        args = {"pid": pid, "cols": cols, "rows": rows, "owner": owner}
        await self._call(session_id, "resize_terminal", args)

    async def hang_up(self, session_id: str, pid: int, owner: str | None = None) -> None:
        await self._call(session_id, "hang_up", {"pid": pid, "owner": owner})

    async def _listen(
        self, session_id: str, op: str, args: dict[str, Any]
    ) -> tuple[int, AsyncIterator[Event]]:
        """A request whose events are a process's: its pid (the first event), then its
        events as an iterator; closing the iterator cancels the request on the node."""
        queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()
        call = asyncio.ensure_future(self._call(session_id, op, args, queue.put_nowait))

        def ended(done: asyncio.Future[Any]) -> None:  # the node answered: the stream is over
            if not done.cancelled():
                queue.put_nowait(done.exception() or ProcessError("the node ended the stream"))

        call.add_done_callback(ended)
        first = await queue.get()
        if isinstance(first, BaseException):
            raise first
        pid = int(first["pid"])

        async def events() -> AsyncIterator[Event]:
            try:
                while True:
                    item = await queue.get()
                    if isinstance(item, LinkDown):
                        raise node_failed(session_id) from None
                    if isinstance(item, BaseException):
                        yield Exit(pid, None, None)  # the node or the session went
                        return
                    event = codec.event_in(item)
                    yield event
                    if isinstance(event, Exit):
                        return
            finally:
                call.cancel()
                with contextlib.suppress(BaseException):
                    await call

        return pid, events()
