"""A session's commands and terminals: processes in its sandbox beside its cells.

One process model serves every face of it (`/v1/.../commands`, terminals, E2B's Process
service, MCP, the CLI): a process is started by the sandbox's supervisor as the session's
user (or root, where the server allows it), in its home, with the template's environment
and the session's; a foreground run collects its output up to --output-limit and ends it
at its timeout; a background one runs on, listed, until it ends or is killed. Every
process's end is told (`command.finished`), counted, and kept in the session's history
(`kind: "command"`), with its output cut to --history-output-bytes.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cloche.errors import Forbidden, NotSupported, ProcessError
from cloche.sessions.processes import Event, Exit, Output, ProcessTable, Watcher

log = logging.getLogger("cloche.session")
DEFAULT_TIMEOUT_S = 60.0  # a foreground command's, as E2B's; 0: none
MAX_ARGS_BYTES = 1 << 20  # a command line, its arguments and environment together
END_TOLD_S = 30.0  # a killed command's end is told at once; past this its supervisor is stuck
UNCONFIRMED = "\n[cloche: the sandbox's process supervisor did not tell the command's end]"


@dataclass(frozen=True)
class CommandSpec:
    """What to run. `cmd` alone is a command line for the template's shell; with `args`
    it is the program, executed directly with them."""

    cmd: str
    args: tuple[str, ...] | None = None
    cwd: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None  # None: the session's user; "root" where allowed
    timeout_s: float | None = None  # None: DEFAULT_TIMEOUT_S in the foreground, none behind
    stdin: bool = False
    tag: str | None = None
    pty: tuple[int, int] | None = None  # (cols, rows): a terminal

    @property
    def line(self) -> str:
        """The command as a person would type it (for listings and the history)."""
        if self.args is None:
            return self.cmd
        return " ".join([self.cmd, *self.args])


@dataclass
class CommandResult:
    """A finished command."""

    pid: int
    exit_code: int | None = None  # when it exited on its own
    signal: int | None = None  # the signal that ended it, when one did
    stdout: str = ""
    stderr: str = ""
    status: str = "exited"  # exited, signaled, timeout, killed
    # ok, error, signaled, timeout, killed, output_limit, sandbox_died; paused: the caller's
    # run ended because its session was paused (the process goes on in its image)
    end_reason: str = "ok"
    duration_ms: float = 0.0
    dropped_bytes: int = 0  # output past --output-limit, not kept

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "exit_code": self.exit_code,
            "signal": _signal_name(self.signal),
            "stdout": self.stdout,
            "stderr": self.stderr,
            "status": self.status,
            "end_reason": self.end_reason,
            "duration_ms": round(self.duration_ms, 3),
        }


EventSink = Callable[[dict[str, Any]], None]


class Collected:
    """A process's output taken from a watcher, kept up to a limit, and how it ended."""

    def __init__(self, pid: int, limit_bytes: int, on_event: EventSink | None = None) -> None:
        self.result = CommandResult(pid)
        self.limit = limit_bytes
        self.kept = {1: bytearray(), 2: bytearray()}
        self.on_event = on_event
        self.started = time.perf_counter()
        self.ending: str | None = None  # "timeout" or "killed" once cloche ended it

    async def drain(self, watcher: Watcher) -> CommandResult:
        end: Exit | None = None
        async for event in watcher:
            if isinstance(event, Output):
                self._keep(event)
            else:
                end = event
        return self.finish(end)

    def _keep(self, output: Output) -> None:
        kept = self.kept[output.fd]
        room = self.limit - len(self.kept[1]) - len(self.kept[2])
        kept += output.data[: max(room, 0)]
        self.result.dropped_bytes += max(len(output.data) - max(room, 0), 0)
        if self.on_event is not None:
            self.on_event({"type": "stdout" if output.fd == 1 else "stderr", "data": output.data})

    def finish(self, end: Exit | None) -> CommandResult:
        result = self.result
        result.duration_ms = (time.perf_counter() - self.started) * 1000
        result.stdout = self.kept[1].decode(errors="replace")
        result.stderr = self.kept[2].decode(errors="replace")
        if end is not None and end.suspended:
            result.status, result.end_reason = "killed", "paused"
        elif end is None and self.ending is not None:  # its end was never told
            result.status = result.end_reason = self.ending
            result.stderr += UNCONFIRMED
        elif end is None or (end.exit_code is None and end.signal is None):
            result.status, result.end_reason = "killed", "sandbox_died"
        elif self.ending is not None:
            result.status = result.end_reason = self.ending
            result.signal = end.signal
        elif end.signal is not None:
            result.status, result.end_reason, result.signal = "signaled", "signaled", end.signal
        else:
            result.exit_code = end.exit_code
            result.end_reason = "ok" if end.exit_code == 0 else "error"
        if result.dropped_bytes and result.end_reason in ("ok", "error"):
            result.end_reason = "output_limit"
            marker = f"\n[cloche: {result.dropped_bytes} more bytes of output (--output-limit)]"
            if result.stderr or not result.stdout:
                result.stderr += marker
            else:
                result.stdout += marker
        return result


class Commands:
    """Starts and reaches a session's processes over its kernel's process table."""

    def __init__(
        self,
        *,
        root_allowed: bool,
        output_limit: int,
        history_bytes: int,
        finished: Callable[[Any, CommandSpec, CommandResult, str], None],
    ) -> None:
        self.root_allowed = root_allowed
        self.output_limit = output_limit
        self.history_bytes = history_bytes
        self.finished = finished  # (session, spec, result, front end): history, events, metrics
        self._recorders: set[asyncio.Task[None]] = set()

    def request_fields(
        self, spec: CommandSpec, sandbox: Any, env: Mapping[str, str]
    ) -> dict[str, Any]:
        """The supervisor's `proc.start` fields for spec.

        Raises:
            Forbidden: root asked of a server with --no-root.
            ProcessError: a spec that can't be run (too large).
        """
        user = spec.user or sandbox.user
        if user == "root" and not (self.root_allowed and sandbox.root_inside):
            raise Forbidden(
                "commands may not run as root here: the server runs with --no-root (nothing "
                "in its sandboxes has uid 0)"
            )
        system = getattr(sandbox, "system", None)
        if spec.args is not None:
            argv = [spec.cmd, *spec.args]
        elif spec.pty is not None and not spec.cmd:
            shell = system.shell_path if system is not None else "/bin/sh"
            argv = [shell, "-l"] if shell.endswith("bash") else [shell]
        else:
            argv = [*(system.shell_command if system is not None else ["/bin/sh", "-c"]), spec.cmd]
        merged = {**env, **spec.env}
        if spec.pty is not None:
            merged.setdefault("TERM", "xterm-256color")
        size = sum(len(a) for a in argv) + sum(len(k) + len(v) for k, v in merged.items())
        if size > MAX_ARGS_BYTES:
            raise ProcessError(
                f"the command and its environment hold {size} bytes, over {MAX_ARGS_BYTES}"
            )
        return {
            "argv": argv,
            "cwd": spec.cwd or (system.home if system is not None else None),
            "env": merged,
            "user": user,
            "stdin": spec.stdin,
            "pty": {"cols": spec.pty[0], "rows": spec.pty[1]} if spec.pty else None,
            "tag": spec.tag,
            "cmd": spec.line,
        }

    async def run(
        self,
        session: Any,
        table: ProcessTable,
        fields: dict[str, Any],
        spec: CommandSpec,
        *,
        on_event: EventSink | None = None,
        front_end: str = "",
    ) -> CommandResult:
        """Run a command to its end, or its timeout; a caller that goes away kills it."""
        pid, (watcher,) = await table.start(**fields)
        collected = Collected(pid, self.output_limit, on_event)
        if on_event is not None:
            on_event({"type": "start", "pid": pid})
        timeout = DEFAULT_TIMEOUT_S if spec.timeout_s is None else spec.timeout_s
        drain = asyncio.ensure_future(collected.drain(watcher))
        try:
            async with asyncio.timeout(timeout or None):
                result = await asyncio.shield(drain)
        except TimeoutError:
            collected.ending = "timeout"
            result = await _kill_and_drain(table, pid, drain, watcher)
        except asyncio.CancelledError:
            collected.ending = "killed"
            await asyncio.shield(
                self._kill_and_finish(table, pid, drain, watcher, session, spec, front_end)
            )
            raise
        if result.end_reason != "paused":  # else its end is recorded once resumed
            self.finished(session, spec, result, front_end)
        return result

    async def _kill_and_finish(
        self,
        table: ProcessTable,
        pid: int,
        drain: asyncio.Future[CommandResult],
        watcher: Watcher,
        session: Any,
        spec: CommandSpec,
        front_end: str,
    ) -> None:
        self.finished(session, spec, await _kill_and_drain(table, pid, drain, watcher), front_end)

    async def start(
        self,
        session: Any,
        table: ProcessTable,
        fields: dict[str, Any],
        spec: CommandSpec,
        *,
        front_end: str = "",
        watchers: int = 0,
    ) -> tuple[int, list[Watcher]]:
        """Start a command in the background; its pid, and `watchers` more watchers of it
        from its first output. It is recorded when it ends."""
        pid, made = await table.start(watchers=1 + watchers, **fields)
        self.follow(session, table, pid, made[0], spec, front_end)
        return pid, made[1:]

    def follow(
        self,
        session: Any,
        table: ProcessTable,
        pid: int,
        watcher: Watcher,
        spec: CommandSpec,
        front_end: str,
    ) -> None:
        """Record a running process when it ends (not if its session is paused first)."""
        collected = Collected(pid, self.history_bytes)

        async def record() -> None:
            drain = asyncio.ensure_future(collected.drain(watcher))
            try:
                if spec.timeout_s:
                    try:
                        async with asyncio.timeout(spec.timeout_s):
                            await asyncio.shield(drain)
                    except TimeoutError:
                        collected.ending = "timeout"
                        await _kill_and_drain(table, pid, drain, watcher)
                result = await drain
            except asyncio.CancelledError:  # the server is stopping
                watcher.close()
                raise
            if result.end_reason != "paused":  # else its end is recorded once resumed
                self.finished(session, spec, result, front_end)

        task = asyncio.ensure_future(record())
        self._recorders.add(task)
        task.add_done_callback(self._recorders.discard)

    async def stop(self) -> None:
        """Stop recording (the server stops)."""
        for task in list(self._recorders):
            task.cancel()
        await asyncio.gather(*self._recorders, return_exceptions=True)


async def _kill_and_drain(
    table: ProcessTable, pid: int, drain: asyncio.Future[CommandResult], watcher: Watcher
) -> CommandResult:
    """Kill a command's tree and take its end; a supervisor that tells no end within
    END_TOLD_S (stuck, its sandbox wedged) leaves the command ended as cloche ended it."""
    await _kill(table, pid)
    try:
        async with asyncio.timeout(END_TOLD_S):
            return await asyncio.shield(drain)
    except TimeoutError:
        log.warning("process %d: its end was not told after it was killed", pid)
        watcher.abandon()
        return await drain


async def _kill(table: ProcessTable, pid: int) -> None:
    with contextlib.suppress(ProcessError):  # ended meanwhile, or the sandbox is gone
        await table.request("proc.kill", pid=pid)


def signal_number(name: str | int) -> int:
    """A signal by name (SIGTERM, TERM) or number.

    Raises:
        ProcessError: no such signal.
    """
    if isinstance(name, int) and not isinstance(name, bool):
        number = name
    else:
        text = str(name).upper()
        text = text if text.startswith("SIG") else f"SIG{text}"
        try:
            number = int(signal.Signals[text])
        except KeyError:
            raise ProcessError(f"no signal {name!r} (e.g. SIGTERM, SIGKILL, SIGINT)") from None
    if not 0 < number < signal.NSIG:
        raise ProcessError(f"no signal {name!r}")
    return number


def _signal_name(number: int | None) -> str | None:
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


class ProcessVerbs(abc.ABC):  # noqa: B024  # every verb has a default: it says it can't
    """A session's processes, as front ends reach them: every manager has these verbs; one
    that can't serve them (a cluster's front end, for now) says so (NotSupported).

    All raise SessionNotFound for an unknown session or another owner's, and resume a
    paused session first; ProcessNotFound for a pid that is not running.
    """

    async def run_command(
        self,
        session_id: str,
        spec: CommandSpec,
        *,
        owner: str | None = None,
        on_event: EventSink | None = None,
        front_end: str = "",
    ) -> CommandResult:
        """Run a command to its end (or its timeout, or the caller's going: then killed).
        on_event gets {"type": "start", "pid"}, then {"type": "stdout"|"stderr", "data":
        bytes} as output comes.

        Raises:
            Forbidden: root asked of a server with --no-root.
            ProcessError: it could not be started (no such user, directory, ...).
        """
        raise NotSupported(_NOT_HERE)

    async def start_command(
        self, session_id: str, spec: CommandSpec, *, owner: str | None = None, front_end: str = ""
    ) -> int:
        """Start a command (or, with spec.pty, a terminal) in the background; its pid."""
        raise NotSupported(_NOT_HERE)

    async def open_command(
        self, session_id: str, spec: CommandSpec, *, owner: str | None = None, front_end: str = ""
    ) -> tuple[int, AsyncIterator[Event]]:
        """Start a command (or, with spec.pty, a terminal) and listen to it from its very
        first output: its pid, and its events until its end. Closing the events leaves the
        process running (a terminal's caller hangs it up)."""
        raise NotSupported(_NOT_HERE)

    async def commands(self, session_id: str, owner: str | None = None) -> list[dict[str, Any]]:
        """The session's running processes: pid, cmd, tag, pty, started_at, ..."""
        raise NotSupported(_NOT_HERE)

    async def watch_command(
        self, session_id: str, pid: int, owner: str | None = None
    ) -> AsyncIterator[Event]:
        """A running process's output from now on, then its end (an Exit): listening
        starts when this returns."""
        raise NotSupported(_NOT_HERE)

    async def command_input(
        self, session_id: str, pid: int, data: bytes, *, eof: bool = False, owner: str | None = None
    ) -> None:
        """Write to a process's stdin (a terminal's input); eof closes it after data."""
        raise NotSupported(_NOT_HERE)

    async def signal_command(
        self, session_id: str, pid: int, number: int, owner: str | None = None
    ) -> None:
        """Send a signal to a process's group."""
        raise NotSupported(_NOT_HERE)

    async def kill_command(self, session_id: str, pid: int, owner: str | None = None) -> None:
        """Kill a process and everything it started."""
        raise NotSupported(_NOT_HERE)

    async def resize_terminal(
        self, session_id: str, pid: int, cols: int, rows: int, owner: str | None = None
    ) -> None:
        """Set a terminal's size."""
        raise NotSupported(_NOT_HERE)

    async def hang_up(self, session_id: str, pid: int, owner: str | None = None) -> None:
        """Hang a terminal up: SIGHUP to its processes, SIGKILL to what is left after a
        grace."""
        raise NotSupported(_NOT_HERE)


_NOT_HERE = "commands and terminals are not offered by this server (a cluster's front end)"


class ForwardedProcessVerbs(ProcessVerbs):
    """The process verbs of a manager that wraps another (`inner`): passed on as they are."""

    @property
    def _verbs(self) -> ProcessVerbs:
        inner: ProcessVerbs = getattr(self, "inner")  # noqa: B009  # the wrapper's own
        return inner

    async def run_command(self, *args: Any, **kwargs: Any) -> CommandResult:
        return await self._verbs.run_command(*args, **kwargs)

    async def start_command(self, *args: Any, **kwargs: Any) -> int:
        return await self._verbs.start_command(*args, **kwargs)

    async def open_command(self, *args: Any, **kwargs: Any) -> tuple[int, AsyncIterator[Event]]:
        return await self._verbs.open_command(*args, **kwargs)

    async def commands(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return await self._verbs.commands(*args, **kwargs)

    async def watch_command(self, *args: Any, **kwargs: Any) -> AsyncIterator[Event]:
        return await self._verbs.watch_command(*args, **kwargs)

    async def command_input(self, *args: Any, **kwargs: Any) -> None:
        await self._verbs.command_input(*args, **kwargs)

    async def signal_command(self, *args: Any, **kwargs: Any) -> None:
        await self._verbs.signal_command(*args, **kwargs)

    async def kill_command(self, *args: Any, **kwargs: Any) -> None:
        await self._verbs.kill_command(*args, **kwargs)

    async def resize_terminal(self, *args: Any, **kwargs: Any) -> None:
        await self._verbs.resize_terminal(*args, **kwargs)

    async def hang_up(self, *args: Any, **kwargs: Any) -> None:
        await self._verbs.hang_up(*args, **kwargs)
