"""The MCP tools' surface over the manager (/mcp inside the server), against a recording
fake manager: every call is the caller's, and reads as the HTTP API answers it. The tools
themselves, end to end over real gVisor, are in test_mcp.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from cloche.config import Limits
from cloche.errors import SessionNotFound
from cloche.server.mcp.direct import ManagerClient
from cloche.sessions.commands import CommandResult, CommandSpec
from cloche.sessions.history import CellEntry
from cloche.sessions.result import CellResult, CellStatus
from cloche.sessions.session import SessionInfo, SessionState
from cloche.sessions.store import SnapshotRecord

TOKEN = "a-token"


def _info(session_id: str, profile: str = "lean") -> SessionInfo:
    now = time.time()
    return SessionInfo(session_id, TOKEN, SessionState.IDLE, now, now, 2, 0, profile)


class RecordingManager:
    """The SessionManager calls the surface makes, each recorded with its owner."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.closed: set[str] = set()

    async def create(
        self,
        owner: str | None,
        profile: str = "lean",
        snapshot: Any = None,
        egress: Any = None,
        metadata: Any = None,
        template: Any = None,
    ):
        self.calls.append(("create", owner))
        self.egress = egress
        self.metadata = metadata
        self.template = template
        return _info("s1", profile)

    async def run_command(self, session_id: str, spec: CommandSpec, *, owner=None, front_end=""):
        self.calls.append(("run_command", owner))
        self.command = (session_id, spec, front_end)
        return CommandResult(7, exit_code=3, stdout="out\n", stderr="err\n", end_reason="error")

    async def info(self, session_id: str, owner: str | None = None) -> SessionInfo:
        self.calls.append(("info", owner))
        if session_id in self.closed:
            raise SessionNotFound(session_id)
        return _info(session_id)

    async def sessions(self, owner: str | None = None, **filters: Any) -> list[SessionInfo]:
        self.calls.append(("sessions", owner))
        self.filters = filters
        return [_info("s1")]

    async def history(self, session_id: str, owner=None, *, after=0, limit=None):
        self.calls.append(("history", owner))
        self.asked = (session_id, after, limit)
        now = time.time()
        return [
            CellEntry(
                number=4,
                execution_count=2,
                code="6 * 7",
                status="ok",
                end_reason="ok",
                started_at=now - 0.5,
                ended_at=now,
                duration_s=0.5,
                stdout="out\n",
                stderr="",
                result={"text/plain": "42"},
                front_end="http",
            )
        ]

    async def execute(self, session_id: str, code: str, *, owner=None, timeout_s=None, **_):
        self.calls.append(("execute", owner))
        self.timeout_s = timeout_s
        return CellResult(
            status=CellStatus.ERROR,
            streams=[("stdout", "hi\n")],
            error={"ename": "ZeroDivisionError", "evalue": "division by zero", "traceback": []},
            execution_count=3,
            duration_ms=1.5,
        )

    async def write_files(self, session_id: str, files, owner=None) -> None:
        self.calls.append(("write_files", owner))
        self.written = list(files)

    async def read_file(self, session_id: str, path: str, owner=None) -> bytes:
        self.calls.append(("read_file", owner))
        return b"content of " + path.encode()

    async def snapshot(self, session_id: str, owner=None, name: str = "") -> SnapshotRecord:
        self.calls.append(("snapshot", owner))
        return SnapshotRecord("snap", session_id, name, TOKEN, "lean", time.time(), 2, 123, "o")

    async def fork(self, session_id: str, count: int = 1, owner=None) -> list[SessionInfo]:
        self.calls.append(("fork", owner))
        return [_info(f"copy{i}") for i in range(count)]

    async def close(self, session_id: str, owner=None, reason: str = "closed") -> None:
        self.calls.append(("close", owner))
        self.reason = reason
        if session_id in self.closed:
            raise SessionNotFound(session_id)
        self.closed.add(session_id)


@pytest.fixture
def manager() -> RecordingManager:
    return RecordingManager()


def _client(manager: RecordingManager, timeouts: dict[str, float] | None = None) -> ManagerClient:
    return ManagerClient(manager, TOKEN, Limits(), {} if timeouts is None else timeouts)  # type: ignore[arg-type]


async def test_every_call_reaches_the_manager_as_the_callers_token(manager):
    client = _client(manager)
    session = await client.create_session(
        "data", egress="research", metadata={"a": "b"}, template="python"
    )
    assert (session.id, session.info.profile) == ("s1", "data")
    assert manager.template == "python"
    assert manager.egress == "research"  # MCP's create_session asks for the policy named
    assert manager.metadata == {"a": "b"}
    await session.refresh()
    await client.list_sessions(state="idle", profile="data", metadata={"a": "b"})
    assert manager.filters == {"state": "idle", "profile": "data", "metadata": {"a": "b"}}
    (cell,) = await session.history(3, 10)
    assert manager.asked == ("s1", 3, 10)
    assert (cell.number, cell.code, cell.front_end) == (4, "6 * 7", "http")
    assert (cell.execution.text, cell.execution.logs.stdout) == ("42", "out\n")
    assert (cell.execution.execution_count, cell.execution.duration_ms) == (2, 500.0)
    assert cell.execution.session_id == "s1" and cell.end_reason == "ok"
    await session.run("1 / 0")
    await session.upload("a.txt", b"x")
    assert await session.download("a.txt") == b"content of a.txt"
    snapshot = await session.snapshot("before")
    assert (snapshot.id, snapshot.name, snapshot.size_bytes) == ("snap", "before", 123)
    copies = await session.fork(2)
    assert [copy.id for copy in copies] == ["copy0", "copy1"]
    await session.close()
    assert {owner for _, owner in manager.calls} == {TOKEN}
    assert manager.written == [("a.txt", b"x")]
    assert manager.reason == "deleted"  # as DELETE /v1/sessions/{id} closes it


async def test_a_cell_reads_as_the_http_api_answers_it(manager):
    session = await _client(manager).session("s1")
    execution = await session.run("1 / 0")
    assert execution.session_id == "s1"
    assert execution.status == "error" and execution.execution_count == 3
    assert execution.logs.stdout == "hi\n"
    assert execution.error is not None and execution.error.ename == "ZeroDivisionError"


async def test_a_cell_gets_the_time_limit_its_session_was_made_with(manager):
    timeouts = {"s1": 5.0}
    session = await _client(manager, timeouts).session("s1")
    assert session.info.cell_timeout_s == 5.0
    await session.run("1")
    assert manager.timeout_s == 5.0
    await session.run("1", timeout=2.0)
    assert manager.timeout_s == 2.0
    await session.close()
    assert timeouts == {}  # forgotten with the session, as over HTTP


async def test_closing_twice_is_fine_and_an_ended_session_is_not_found(manager):
    client = _client(manager)
    session = await client.session("s1")
    await session.close()
    await session.close()
    with pytest.raises(SessionNotFound):
        await client.session("s1")


async def test_a_command_reads_as_the_http_api_answers_it(manager):
    session = await _client(manager).session("s1")
    result = await session.commands.run("ls", args=["-l"], cwd="/tmp", user="root", timeout=5)
    assert (result.pid, result.exit_code, result.status, result.end_reason) == (
        7,
        3,
        "exited",
        "error",
    )
    assert (result.stdout, result.stderr, result.ok) == ("out\n", "err\n", False)
    session_id, spec, front_end = manager.command
    assert (session_id, front_end) == ("s1", "mcp")
    assert (spec.cmd, spec.args, spec.cwd, spec.user, spec.timeout_s) == (
        "ls",
        ("-l",),
        "/tmp",
        "root",
        5,
    )
    assert manager.calls[-1] == ("run_command", TOKEN)
