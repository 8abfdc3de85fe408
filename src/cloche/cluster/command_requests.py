"""What a node agent answers front ends about its sessions' processes: each of the process
verbs done by the node's manager (`cluster/commands.py` is the front end's side). A
process's events go out as the request's events, its pid first; a front end that goes away
cancels the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from cloche.cluster import codec
from cloche.sessions.kernel import EventCallback
from cloche.sessions.local import LocalSessionManager
from cloche.sessions.processes import Event


class CommandRequests:
    """What a node agent answers about its sessions' processes (a part of `NodeAgent`)."""

    manager: LocalSessionManager

    async def _op_run_command(
        self,
        on_event: EventCallback,
        session_id: str,
        spec: dict[str, Any],
        owner: str | None,
        front_end: str = "",
    ) -> Any:
        result = await self.manager.run_command(
            session_id,
            codec.spec_in(spec),
            owner=owner,
            on_event=lambda event: on_event(codec.run_event_out(event)),
            front_end=front_end,
        )
        return codec.command_result_out(result)

    async def _op_start_command(
        self,
        on_event: EventCallback,
        session_id: str,
        spec: dict[str, Any],
        owner: str | None,
        front_end: str = "",
    ) -> Any:
        return await self.manager.start_command(
            session_id, codec.spec_in(spec), owner=owner, front_end=front_end
        )

    async def _op_open_command(
        self,
        on_event: EventCallback,
        session_id: str,
        spec: dict[str, Any],
        owner: str | None,
        front_end: str = "",
    ) -> Any:
        pid, events = await self.manager.open_command(
            session_id, codec.spec_in(spec), owner=owner, front_end=front_end
        )
        return await _relay(pid, events, on_event)

    async def _op_watch_command(
        self, on_event: EventCallback, session_id: str, pid: int, owner: str | None
    ) -> Any:
        events = await self.manager.watch_command(session_id, pid, owner)
        return await _relay(pid, events, on_event)

    async def _op_commands(
        self, on_event: EventCallback, session_id: str, owner: str | None
    ) -> Any:
        return await self.manager.commands(session_id, owner)

    async def _op_command_input(
        self,
        on_event: EventCallback,
        session_id: str,
        pid: int,
        data: str,
        eof: bool,
        owner: str | None,
    ) -> Any:
        await self.manager.command_input(
            session_id, pid, codec.bytes_in(data), eof=eof, owner=owner
        )

    async def _op_signal_command(
        self, on_event: EventCallback, session_id: str, pid: int, number: int, owner: str | None
    ) -> Any:
        await self.manager.signal_command(session_id, pid, number, owner)

    async def _op_kill_command(
        self, on_event: EventCallback, session_id: str, pid: int, owner: str | None
    ) -> Any:
        await self.manager.kill_command(session_id, pid, owner)

    async def _op_resize_terminal(
        self,
        on_event: EventCallback,
        session_id: str,
        pid: int,
        cols: int,
        rows: int,
        owner: str | None,
    ) -> Any:
        await self.manager.resize_terminal(session_id, pid, cols, rows, owner)

    async def _op_hang_up(
        self, on_event: EventCallback, session_id: str, pid: int, owner: str | None
    ) -> Any:
        await self.manager.hang_up(session_id, pid, owner)


async def _relay(pid: int, events: AsyncIterator[Event], on_event: EventCallback) -> None:
    """A process's pid, then its events, as the request's events, until its end."""
    on_event({"pid": pid})
    try:
        async for event in events:
            on_event(codec.event_out(event))
    finally:
        await events.aclose()  # type: ignore[attr-defined]
