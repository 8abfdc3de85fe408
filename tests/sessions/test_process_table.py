"""The host's view of a sandbox's processes (sessions.processes.ProcessTable), against the
frames a process supervisor sends, in the order it sends them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cloche.errors import ProcessNotFound
from cloche.sessions.processes import Exit, ProcessTable


class Supervisor:
    """Answers each request with the frames given for its op (its end first, say)."""

    def __init__(self, frames: dict[str, list[dict[str, Any]]]) -> None:
        self.frames = frames
        self.table = ProcessTable(self.send)
        self.asked: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        self.asked.append(message)
        for frame in self.frames.get(message["op"], []):
            frame = {**frame, "rid": message["rid"]} if frame["op"] == "proc.reply" else frame
            asyncio.get_running_loop().call_soon(self.table.on_message, frame)


async def test_a_process_whose_end_was_told_while_it_was_asked_about_is_known() -> None:
    # A kill's reply, then the client attaches: the supervisor reaps the leader and tells
    # its end just before it answers the probe that the process is gone.
    supervisor = Supervisor(
        {
            "proc.signal": [
                {"op": "proc.exit", "pid": 11, "exit_code": None, "signal": 9},
                {"op": "proc.reply", "error": "process 11 is not running"},
            ]
        }
    )
    await supervisor.table.known(11)
    watcher = supervisor.table.watch(11)
    assert [event async for event in watcher] == [Exit(11, None, 9)]


async def test_a_process_ended_lately_is_known_without_asking() -> None:
    supervisor = Supervisor({})
    supervisor.table.on_message({"op": "proc.exit", "pid": 7, "exit_code": 0, "signal": None})
    await supervisor.table.known(7)
    assert supervisor.asked == []


async def test_a_process_never_seen_is_not_found() -> None:
    supervisor = Supervisor(
        {"proc.signal": [{"op": "proc.reply", "error": "process 12 is not running"}]}
    )
    with pytest.raises(ProcessNotFound, match="process 12 is not running"):
        await supervisor.table.known(12)
