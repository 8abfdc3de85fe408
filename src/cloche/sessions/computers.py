"""Sessions as computers: commands, terminals and ports beside the cells, in the same sandbox.

The third layer of `LocalSessionManager` (`sessions.local`), over `sessions.running`: the
process verbs of `commands.ProcessVerbs` and the port verbs of `ports.PortVerbs` on live
sessions. A request for a paused session resumes it first, as a cell does. While a process
is watched (a foreground run, an attached stream, a terminal) or a port is reached, its
session is in use: not frozen, paused or closed for idleness.
"""

from __future__ import annotations

import base64
import functools
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

from cloche.errors import ClocheError, Forbidden, ProcessError, SessionLost, SessionNotFound
from cloche.sandbox.bundle import DOOR_MOUNT
from cloche.sessions import filesystem
from cloche.sessions.commands import (
    CommandResult,
    Commands,
    CommandSpec,
    EventSink,
)
from cloche.sessions.filesystem import Entry
from cloche.sessions.history import CellEntry, cut
from cloche.sessions.ports import Owner, OwnerKey, PortTarget
from cloche.sessions.processes import Event, ProcessTable, Watcher
from cloche.sessions.running import RunningSessions
from cloche.sessions.session import Session

log = logging.getLogger("cloche.session")
EGRESS_PORT = 3128  # the kernel's proxy on the sandbox's loopback (kernel/egress.py)

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _told_if_died(
    verb: Callable[Concatenate[ComputerSessions, str, _P], Coroutine[Any, Any, _T]],
) -> Callable[Concatenate[ComputerSessions, str, _P], Coroutine[Any, Any, _T]]:
    """A process verb whose sandbox dies while the supervisor is asked answers as a
    request to a session that is gone (SessionNotFound, with how it died), not as a
    process that could not be reached: there is no process left to reach."""

    @functools.wraps(verb)
    async def told(
        self: ComputerSessions, session_id: str, /, *args: _P.args, **kwargs: _P.kwargs
    ) -> _T:
        try:
            return await verb(self, session_id, *args, **kwargs)
        except ProcessError as exc:
            why = self._died_of(session_id)
            if why is None:
                raise
            raise SessionNotFound(session_id, why) from exc

    return told


class ComputerSessions(RunningSessions):
    """Live sessions that run commands and terminals."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.command_runs = Commands(
            root_allowed=not self.config.no_root,
            output_limit=self.limits.output_bytes,
            history_bytes=self.config.history_output_bytes,
            finished=self._command_finished,
        )

    async def _reach(self, session_id: str, owner: str | None) -> tuple[Session, ProcessTable]:
        """A session, resumed and awake, and its kernel's process table."""
        session = self._find(session_id, owner)
        await session.wake()
        session.touch()
        session.idle_from_now()  # a request is activity: the idle clock starts again
        kernel = session.kernel
        if kernel is None or not kernel.alive:
            raise SessionNotFound(session_id)
        kernel.sandbox.thaw()
        return session, kernel.processes

    def _died_of(self, session_id: str) -> str | None:
        """How a session's sandbox died, if it has (or the session has gone meanwhile)."""
        session = self._sessions.get(session_id)
        if session is None:
            return "it ended while it was asked"
        kernel = session.kernel
        if kernel is None or kernel.alive:
            return None
        return kernel.death or "its sandbox has ended"

    def _owned(self, session_id: str, owner: Owner) -> Session:
        """A session of the owner's: by its token, or by its key (a preview token's)."""
        if not isinstance(owner, OwnerKey):
            return self._find(session_id, owner)
        session = self._sessions.get(session_id)
        if session is None or session.owner_key != owner.key or not session.usable:
            lost = self._lost.get(session_id)
            if lost is not None and lost[0] == owner.key:
                raise SessionLost(session_id, lost[1])
            raise SessionNotFound(session_id)
        return session

    @asynccontextmanager
    async def _ports_door(self, session_id: str, owner: Owner) -> AsyncIterator[Session]:
        """A session, resumed, awake and in use for the block, with its ports door."""
        session = self._owned(session_id, owner)
        await session.wake()
        session.touch()
        kernel = session.kernel
        if kernel is None or not kernel.alive:
            raise SessionNotFound(session_id)
        kernel.sandbox.thaw()
        async with self._in_use(session):
            yield session

    async def ports(self, session_id: str, owner: Owner = None) -> list[int]:
        async with self._ports_door(session_id, owner) as session:
            found = await (await self.doors.ports_door(session)).listening()
        return [p for p in found if not (session.egress is not None and p == EGRESS_PORT)]

    @asynccontextmanager
    async def _reach_port(
        self, session_id: str, port: int, owner: Owner = None
    ) -> AsyncIterator[PortTarget]:
        async with self._ports_door(session_id, owner) as session:
            if session.egress is not None and port == EGRESS_PORT:
                raise Forbidden(
                    f"port {port} of session {session_id} is its egress proxy, cloche's own: "
                    "it is not reachable from outside"
                )
            yield PortTarget(session.id, port, await self.doors.ports_door(session))

    def reach_port(
        self, session_id: str, port: int, owner: Owner = None
    ) -> AbstractAsyncContextManager[PortTarget]:
        return self._reach_port(session_id, port, owner)

    @asynccontextmanager
    async def _in_use(self, session: Session) -> AsyncIterator[None]:
        session.in_use += 1
        try:
            yield
        finally:
            session.in_use -= 1
            session.touch()
            session.idle_from_now()

    def command_env(self, session: Session) -> dict[str, str]:
        """What a session's commands get: its template's environment, its proxy when it
        has egress, and its own variables."""
        assert session.kernel is not None
        system = getattr(session.kernel.sandbox, "system", None)
        env = dict(item.split("=", 1) for item in (system.env if system else ()) if "=" in item)
        env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        env.setdefault("LANG", "C.UTF-8")
        if session.egress is not None:
            url = f"http://127.0.0.1:{EGRESS_PORT}"
            for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
                env[name] = env[name.lower()] = url
            env["NO_PROXY"] = env["no_proxy"] = "localhost,127.0.0.1,::1"
            bundle = f"{DOOR_MOUNT}/ca.pem"
            for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT"):
                env[name] = bundle
            env["GIT_SSL_CAINFO"] = bundle
            env.update(session.placeholders)
        env.update(session.env)
        return env

    def _fields(self, session: Session, spec: CommandSpec) -> dict[str, Any]:
        assert session.kernel is not None
        return self.command_runs.request_fields(
            spec, session.kernel.sandbox, self.command_env(session)
        )

    def _started(self, session: Session, spec: CommandSpec, pid: int, front_end: str) -> None:
        data = {"pid": pid, "cmd": spec.line, "tag": spec.tag, "front_end": front_end}
        self._tell("command.started", session, {**data, "pty": spec.pty is not None})

    @_told_if_died
    async def run_command(
        self,
        session_id: str,
        spec: CommandSpec,
        *,
        owner: str | None = None,
        on_event: EventSink | None = None,
        front_end: str = "",
    ) -> CommandResult:
        session, table = await self._reach(session_id, owner)
        fields = self._fields(session, spec)

        def events(event: dict[str, Any]) -> None:
            if event["type"] == "start":
                self._started(session, spec, event["pid"], front_end)
            if on_event is not None:
                on_event(event)

        async with self._in_use(session):
            return await self.command_runs.run(
                session, table, fields, spec, on_event=events, front_end=front_end
            )

    @_told_if_died
    async def start_command(
        self, session_id: str, spec: CommandSpec, *, owner: str | None = None, front_end: str = ""
    ) -> int:
        session, table = await self._reach(session_id, owner)
        pid, _ = await self.command_runs.start(
            session, table, self._fields(session, spec), spec, front_end=front_end
        )
        self._started(session, spec, pid, front_end)
        return pid

    @_told_if_died
    async def open_command(
        self, session_id: str, spec: CommandSpec, *, owner: str | None = None, front_end: str = ""
    ) -> tuple[int, AsyncIterator[Event]]:
        session, table = await self._reach(session_id, owner)
        pid, (watcher,) = await self.command_runs.start(
            session, table, self._fields(session, spec), spec, front_end=front_end, watchers=1
        )
        self._started(session, spec, pid, front_end)
        return pid, self._listen(session, watcher)

    async def _listen(self, session: Session, watcher: Watcher) -> AsyncIterator[Event]:
        async with self._in_use(session):
            try:
                async for event in watcher:
                    yield event
            finally:
                watcher.close()

    @_told_if_died
    async def commands(self, session_id: str, owner: str | None = None) -> list[dict[str, Any]]:
        _, table = await self._reach(session_id, owner)
        reply = await table.request("proc.list")
        return [dict(p) for p in reply.get("processes") or [] if isinstance(p, Mapping)]

    @_told_if_died
    async def watch_command(
        self, session_id: str, pid: int, owner: str | None = None
    ) -> AsyncIterator[Event]:
        session, table = await self._reach(session_id, owner)
        await table.known(pid)  # one that ended lately tells its end at once
        return self._listen(session, table.watch(pid))

    @_told_if_died
    async def command_input(
        self, session_id: str, pid: int, data: bytes, *, eof: bool = False, owner: str | None = None
    ) -> None:
        _, table = await self._reach(session_id, owner)
        if data:
            await table.request("proc.input", pid=pid, data=_b64(data))
        if eof:
            await table.request("proc.eof", pid=pid)

    @_told_if_died
    async def signal_command(
        self, session_id: str, pid: int, number: int, owner: str | None = None
    ) -> None:
        _, table = await self._reach(session_id, owner)
        await table.request("proc.signal", pid=pid, signal=number)

    @_told_if_died
    async def kill_command(self, session_id: str, pid: int, owner: str | None = None) -> None:
        _, table = await self._reach(session_id, owner)
        await table.request("proc.kill", pid=pid)

    @_told_if_died
    async def resize_terminal(
        self, session_id: str, pid: int, cols: int, rows: int, owner: str | None = None
    ) -> None:
        _, table = await self._reach(session_id, owner)
        await table.request("proc.resize", pid=pid, cols=cols, rows=rows)

    @_told_if_died
    async def hang_up(self, session_id: str, pid: int, owner: str | None = None) -> None:
        _, table = await self._reach(session_id, owner)
        await table.request("proc.hangup", pid=pid)

    # -- the sandbox's files, as a user (sessions.filesystem) ------------------------------

    async def _as(
        self, session_id: str, owner: str | None, user: str | None
    ) -> tuple[ProcessTable, str]:
        name = filesystem.check_user(user, not self.config.no_root)
        _, table = await self._reach(session_id, owner)
        return table, name

    @_told_if_died
    async def fs_stat(
        self, session_id: str, path: str, *, user: str | None = None, owner: str | None = None
    ) -> Entry:
        table, name = await self._as(session_id, owner, user)
        return Entry.of((await filesystem.ask(table, name, "stat", path)).get("entry"))

    @_told_if_died
    async def fs_list(
        self,
        session_id: str,
        path: str,
        depth: int = 1,
        *,
        user: str | None = None,
        owner: str | None = None,
    ) -> list[Entry]:
        table, name = await self._as(session_id, owner, user)
        answer = await filesystem.ask(table, name, "list", path, depth=depth)
        return [Entry.of(raw) for raw in answer.get("entries") or []]

    @_told_if_died
    async def fs_make_dir(
        self, session_id: str, path: str, *, user: str | None = None, owner: str | None = None
    ) -> tuple[bool, Entry]:
        table, name = await self._as(session_id, owner, user)
        answer = await filesystem.ask(table, name, "mkdir", path)
        return not answer.get("exists"), Entry.of(answer.get("entry"))

    @_told_if_died
    async def fs_move(
        self,
        session_id: str,
        source: str,
        destination: str,
        *,
        user: str | None = None,
        owner: str | None = None,
    ) -> Entry:
        table, name = await self._as(session_id, owner, user)
        answer = await filesystem.ask(
            table, name, "move", source, source=source, destination=destination
        )
        return Entry.of(answer.get("entry"))

    @_told_if_died
    async def fs_remove(
        self, session_id: str, path: str, *, user: str | None = None, owner: str | None = None
    ) -> None:
        table, name = await self._as(session_id, owner, user)
        await filesystem.ask(table, name, "remove", path)

    @_told_if_died
    async def fs_read(
        self, session_id: str, path: str, *, user: str | None = None, owner: str | None = None
    ) -> tuple[int, AsyncIterator[bytes]]:
        table, name = await self._as(session_id, owner, user)
        return await filesystem.read_pieces(table, name, path)

    @_told_if_died
    async def fs_write(
        self,
        session_id: str,
        path: str,
        chunks: AsyncIterable[bytes],
        *,
        user: str | None = None,
        owner: str | None = None,
    ) -> Entry:
        table, name = await self._as(session_id, owner, user)
        return await filesystem.write_pieces(table, name, path, chunks)

    def _command_finished(
        self, session: Session, spec: CommandSpec, result: CommandResult, front_end: str
    ) -> None:
        """Keep a finished command in its session's history, tell of it and count it."""
        ended = time.time()
        entry = CellEntry(
            number=session.history.next_number(),
            execution_count=0,
            code=spec.line,
            status=result.status,
            end_reason=result.end_reason,
            started_at=ended - result.duration_ms / 1000,
            ended_at=ended,
            duration_s=round(result.duration_ms / 1000, 6),
            stdout=cut(result.stdout, self.config.history_output_bytes),
            stderr=cut(result.stderr, self.config.history_output_bytes),
            result=None,
            front_end=front_end,
            kind="terminal" if spec.pty is not None else "command",
            exit_code=result.exit_code,
        )
        session.history.add(entry)
        self.observer.command_finished(result.end_reason, result.duration_ms / 1000)
        data = {
            "number": entry.number,
            "pid": result.pid,
            "cmd": spec.line,
            "tag": spec.tag,
            "exit_code": result.exit_code,
            "status": result.status,
            "end_reason": result.end_reason,
            "duration_s": entry.duration_s,
            "front_end": front_end,
        }
        self._tell("command.finished", session, data)

    async def _follow_running(self, session: Session) -> None:
        """Record the ends of the processes a session's sandbox came back with (resumed,
        restored or forked: they were part of its image)."""
        kernel = session.kernel
        if kernel is None:
            return
        try:
            reply = await kernel.processes.request("proc.list")
        except ClocheError as exc:
            log.warning("session %s: its processes are not followed: %s", session.id, exc)
            return
        for described in reply.get("processes") or []:
            pid = described.get("pid") if isinstance(described, Mapping) else None
            if type(pid) is not int:
                continue
            spec = CommandSpec(
                cmd=str(described.get("cmd") or ""),
                tag=described.get("tag") if isinstance(described.get("tag"), str) else None,
                pty=(0, 0) if described.get("pty") else None,
            )
            watcher = kernel.processes.watch(pid)
            self.command_runs.follow(session, kernel.processes, pid, watcher, spec, "")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
