"""The blocking facades of a session's commands, processes and terminals: each method runs
the async one (`commands.py`, `process.py`, `terminal.py`) on the client's event-loop
thread and waits, so the behaviour and its errors are written once. Callbacks are called on
that thread, in order.

Example:
    result = session.commands.run("echo hi; exit 3")
    result.exit_code, result.stdout            # 3, 'hi\\n'
    with session.pty() as terminal:
        terminal.write("echo $((6*7))\\n")
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType

from cloche.client._loop import LoopThread
from cloche.client.commands import AsyncCommands, ProcessInfo, Stdin
from cloche.client.process import AsyncProcess, CommandResult, OutputCallback
from cloche.client.terminal import AsyncTerminal


class Commands:
    """A session's commands (`session.commands`); see `AsyncCommands`."""

    def __init__(self, loop: LoopThread, commands: AsyncCommands) -> None:
        self._loop = loop
        self._async = commands

    def run(
        self,
        cmd: str,
        *,
        args: Sequence[str] | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        stdin: Stdin | None = None,
        check: bool = False,
    ) -> CommandResult:
        """Run a command to its end; see `AsyncCommands.run`. Ctrl-C while it runs kills
        it (its stream is dropped, and the server kills a command whose client left)."""
        return self._loop.call(
            self._async.run(
                cmd,
                args=args,
                cwd=cwd,
                env=env,
                user=user,
                timeout=timeout,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                stdin=stdin,
                check=check,
            )
        )

    def start(
        self,
        cmd: str,
        *,
        args: Sequence[str] | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        timeout: float | None = None,
        stdin: bool = False,
        tag: str | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> Process:
        """Start a command in the background; see `AsyncCommands.start`."""
        started = self._async.start(
            cmd,
            args=args,
            cwd=cwd,
            env=env,
            user=user,
            timeout=timeout,
            stdin=stdin,
            tag=tag,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
        )
        return Process(self._loop, self._loop.call(started))

    def list(self) -> builtins.list[ProcessInfo]:
        """The session's running processes (commands and terminals)."""
        return self._loop.call(self._async.list())

    def process(self, pid: int) -> Process:
        """A running process of the session, by pid."""
        return Process(self._loop, self._async.process(pid))


class Process:
    """A process of a session; see `AsyncProcess`. Iterating it yields ("stdout" |
    "stderr", text) as it prints, until it ends."""

    def __init__(self, loop: LoopThread, process: AsyncProcess) -> None:
        self._loop = loop
        self._async = process

    @property
    def pid(self) -> int:
        return self._async.pid

    def attach(
        self, *, on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None
    ) -> None:
        """Begin listening to its output; see `AsyncProcess.attach`."""
        self._loop.call(self._async.attach(on_stdout=on_stdout, on_stderr=on_stderr))

    def wait(self, timeout: float | None = None) -> CommandResult:
        """Wait for its end; see `AsyncProcess.wait`. Raises TimeoutError after timeout."""
        return self._loop.call(self._async.wait(timeout))

    def __iter__(self) -> Iterator[tuple[str, str]]:
        events = self._async.__aiter__()

        async def following() -> tuple[str, str] | None:
            try:
                return await anext(events)
            except StopAsyncIteration:
                return None

        try:
            while (event := self._loop.call(following())) is not None:
                yield event
        finally:
            self._loop.call(events.aclose())  # type: ignore[attr-defined]

    def send_stdin(self, data: bytes | str) -> None:
        """Write to its stdin (started with stdin=True)."""
        self._loop.call(self._async.send_stdin(data))

    def close_stdin(self) -> None:
        """Close its stdin."""
        self._loop.call(self._async.close_stdin())

    def signal(self, name: str | int) -> None:
        """Send a signal (SIGTERM, TERM, or a number) to its process group."""
        self._loop.call(self._async.signal(name))

    def kill(self) -> None:
        """Kill it and everything it started."""
        self._loop.call(self._async.kill())

    def detach(self) -> None:
        """Stop listening; the process runs on."""
        self._loop.call(self._async.detach())

    def __repr__(self) -> str:
        return f"<Process {self.pid} of session {self._async.session_id}>"


class Terminal:
    """A terminal of a session; see `AsyncTerminal`."""

    def __init__(self, loop: LoopThread, terminal: AsyncTerminal) -> None:
        self._loop = loop
        self._async = terminal

    @property
    def exit_code(self) -> int | None:
        """The shell's exit code, once it exited by itself."""
        return self._async.exit_code

    @property
    def signal(self) -> str | None:
        """The signal that ended the shell, if one did."""
        return self._async.signal

    @property
    def ended(self) -> bool:
        return self._async.ended

    def write(self, data: bytes | str) -> None:
        """Type into the terminal."""
        self._loop.call(self._async.write(data))

    def read(self, timeout: float | None = None) -> bytes:
        """The next bytes it shows; b"" once it has ended. Raises TimeoutError after
        timeout."""
        return self._loop.call(self._async.read(timeout))

    def resize(self, cols: int, rows: int) -> None:
        self._loop.call(self._async.resize(cols, rows))

    def wait(self, timeout: float | None = None) -> int | None:
        """Drop its output until the shell ends; its exit code."""
        return self._loop.call(self._async.wait(timeout))

    def close(self) -> None:
        """Close it: the shell is hung up. Idempotent."""
        self._loop.call(self._async.close())

    def __enter__(self) -> Terminal:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Terminal of session {self._async.session_id}>"
