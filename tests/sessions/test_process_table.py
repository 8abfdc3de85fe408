"""The host's view of a sandbox's processes (sessions.processes.ProcessTable), against the
frames a process supervisor sends, in the order it sends them; and a session's idle clock
beside it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from cloche.config import Limits
from cloche.errors import ProcessError, ProcessNotFound
from cloche.sessions import commands
from cloche.sessions.processes import Exit, ProcessTable
from cloche.sessions.result import CellResult, CellStatus
from cloche.sessions.session import Session


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


class FrozenSandbox:
    """What a session's idle clock asks of a sandbox: its CPU (not counted here) and the
    freezer (each freeze counted)."""

    file_owner = None
    workdir = Path("/nonexistent")
    limits = Limits()

    def __init__(self) -> None:
        self.frozen = 0

    def cpu_seconds(self) -> None:
        return None

    def freeze(self) -> None:
        self.frozen += 1

    def thaw(self) -> None:
        pass


class SilentKernel:
    """A kernel whose supervisor has not answered yet (requests are sent, never replied)."""

    alive = True

    def __init__(self) -> None:
        self.sandbox = FrozenSandbox()
        self.processes = ProcessTable(lambda message: None)


async def test_a_session_is_not_frozen_while_its_supervisor_owes_an_answer() -> None:
    # Frozen mid-request, the supervisor would answer nothing until the next cell thawed it:
    # a file read after a pause waited out its 90 s so.
    kernel = SilentKernel()
    session = Session("s", kernel, None, 1, freeze_idle_s=0.01)  # type: ignore[arg-type]
    asked = asyncio.create_task(kernel.processes.request("proc.fs", _timeout_s=0.3, do="stat"))
    with pytest.raises(ProcessError, match="did not answer"):
        await asked
    assert kernel.sandbox.frozen == 0  # not while it was asked
    deadline = asyncio.get_running_loop().time() + 30
    while not kernel.sandbox.frozen:  # idle once answered (or given up on): frozen again
        assert asyncio.get_running_loop().time() < deadline, "never frozen once idle"
        await asyncio.sleep(0.01)
    session._cancel_freeze()


async def test_a_timed_out_command_whose_end_is_never_told_still_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A wedged supervisor: it started the command and answers the kill, but never tells an
    # end. The command ends as cloche ended it (timed out), said so, instead of waiting on.
    monkeypatch.setattr(commands, "END_TOLD_S", 0.2)
    supervisor = Supervisor(
        {
            "proc.start": [{"op": "proc.reply", "pid": 21}],
            "proc.kill": [{"op": "proc.reply", "killed": 1}],
        }
    )
    finished: list[commands.CommandResult] = []
    runs = commands.Commands(
        root_allowed=True,
        output_limit=1 << 20,
        history_bytes=1 << 20,
        finished=lambda session, spec, result, front_end: finished.append(result),
    )
    spec = commands.CommandSpec(cmd="sleep 100", timeout_s=0.1)
    async with asyncio.timeout(10):
        result = await runs.run(None, supervisor.table, {"argv": ["sleep", "100"]}, spec)
    assert (result.status, result.end_reason, result.exit_code) == ("timeout", "timeout", None)
    assert result.stderr.endswith(commands.UNCONFIRMED)
    assert [m["op"] for m in supervisor.asked] == ["proc.start", "proc.kill"]
    assert finished == [result]


class CountingKernel(SilentKernel):
    """A kernel that counts the cells it is given, and how many run at once."""

    def __init__(self) -> None:
        super().__init__()
        self.running = 0
        self.most = 0

    async def execute(self, code: str, **_: Any) -> Any:
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0)
        self.running -= 1
        return CellResult(status=CellStatus.OK)


async def test_a_cell_waits_for_a_wake_that_is_still_setting_the_sandbox_up() -> None:
    # A session resumed at start (no cell asked): its waker attaches the restored kernel,
    # then runs a silent cell of its own (its egress door). A cell asked meanwhile found the
    # session no longer paused and ran beside it: "one cell at a time" failed as a 500.
    kernel = CountingKernel()
    session = Session("s", None, None, 1)
    opened = asyncio.Event()
    may_finish = asyncio.Event()

    async def waker(woken: Session) -> None:
        woken.attach(kernel)  # type: ignore[arg-type]
        opened.set()
        await may_finish.wait()
        await kernel.execute("door", timeout_s=1)

    session.waker = waker
    waking = asyncio.create_task(session.wake())
    await opened.wait()
    cell = asyncio.create_task(session.execute("1", timeout_s=1))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not cell.done() and kernel.running == 0, "the cell ran before the wake ended"
    may_finish.set()
    await waking
    assert (await cell).status is CellStatus.OK
    assert kernel.most == 1
    session._cancel_freeze()
