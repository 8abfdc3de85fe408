"""A session's commands over the HTTP API (`/v1/sessions/{id}/commands`): `session.commands`.

A command runs beside the session's cells, in the same sandbox and filesystem, as the
session's user (or root, where the server allows it). `run` waits for its end (streaming its
output to callbacks as it comes, when given some); `start` leaves it running and answers a
`AsyncProcess` (`process.py`) to wait for, feed, signal or kill.

Example:
    result = await session.commands.run("ls -l /etc | head -3")
    print(result.exit_code, result.stdout)
    server = await session.commands.start("python3 -m http.server 8000", tag="web")
"""

from __future__ import annotations

import asyncio
import builtins
import codecs
from collections.abc import AsyncIterable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from cloche import errors
from cloche.client import _sse
from cloche.client._errors import ANSWER_MARGIN_S, translated
from cloche.client._wire import Wire
from cloche.client.process import (
    AsyncProcess,
    CommandResult,
    OutputCallback,
    called,
    output_bytes,
    stream_error,
)
from cloche.errors import CommandFailed, UnexpectedResponse

DEFAULT_TIMEOUT_S = 60.0  # the server's, for a command run in the foreground that names none
STDIN_CHUNK_BYTES = 64 * 1024  # what one POST .../stdin carries at most
Stdin = bytes | str | Iterable[bytes] | AsyncIterable[bytes]
OutputSink = Callable[[str, bytes], Any]  # ("stdout" or "stderr", the bytes as they came)


@dataclass(frozen=True)
class ProcessInfo:
    """A running process of a session, as `commands.list()` tells it."""

    pid: int
    cmd: str
    tag: str | None = None
    user: str | None = None
    cwd: str | None = None
    pty: bool = False  # a terminal's shell
    started_at: float = 0.0  # Unix time, s

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ProcessInfo:
        return cls(
            pid=int(body["pid"]),
            cmd=str(body.get("cmd") or ""),
            tag=body.get("tag"),
            user=body.get("user"),
            cwd=body.get("cwd"),
            pty=bool(body.get("pty")),
            started_at=float(body.get("started_at") or 0.0),
        )


def command_body(
    cmd: str,
    *,
    args: Sequence[str] | None = None,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    user: str | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 (the server's limit for the command)
    stdin: bool = False,
    background: bool = False,
    tag: str | None = None,
) -> dict[str, Any]:
    """The body of POST /v1/sessions/{id}/commands."""
    body: dict[str, Any] = {"cmd": cmd}
    if args is not None:
        body["args"] = list(args)
    for key, value in (("cwd", cwd), ("user", user), ("timeout", timeout), ("tag", tag)):
        if value is not None:
            body[key] = value
    if env:
        body["env"] = dict(env)
    if stdin:
        body["stdin"] = True
    if background:
        body["background"] = True
    return body


def answer_wait_s(timeout: float | None) -> float | None:  # noqa: ASYNC109
    """How long to wait for a foreground command's answer: its time limit and a margin
    (None: it has none)."""
    if timeout == 0:
        return None
    return (DEFAULT_TIMEOUT_S if timeout is None else timeout) + ANSWER_MARGIN_S


async def stdin_chunks(stdin: Stdin) -> AsyncIterable[bytes]:
    """What to write to a command's stdin, in pieces (a blocking iterable read in a thread)."""
    if isinstance(stdin, str | bytes):
        data = stdin.encode() if isinstance(stdin, str) else stdin
        for start in range(0, len(data), STDIN_CHUNK_BYTES):
            yield data[start : start + STDIN_CHUNK_BYTES]
    elif isinstance(stdin, AsyncIterable):
        async for chunk in stdin:
            yield chunk
    else:
        pieces = iter(stdin)

        def following() -> bytes | None:
            return next(pieces, None)

        while (piece := await asyncio.to_thread(following)) is not None:
            yield piece


class AsyncCommands:
    """A session's commands (`session.commands`)."""

    def __init__(self, client: Wire, session_id: str) -> None:
        self.client = client
        self.session_id = session_id

    @property
    def _path(self) -> str:
        return f"/v1/sessions/{quote(self.session_id, safe='')}/commands"

    async def run(
        self,
        cmd: str,
        *,
        args: Sequence[str] | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the server's limit for the command)
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        stdin: Stdin | None = None,
        check: bool = False,
    ) -> CommandResult:
        """Run a command to its end.

        Args:
            cmd: a command line for the template's shell (`bash -lc`, or `sh -c`); with
                args, the program itself, run directly with them.
            args: the program's arguments (no shell then).
            cwd: where it runs (default: the session's home, /home/user).
            env: more environment variables (the session's own are set already).
            user: whom it runs as: the session's user by default, or "root" (inside the
                sandbox only; refused by a server with --no-root).
            timeout: seconds before its whole process group is killed (the server's
                default is 60; 0: none).
            on_stdout, on_stderr: called with each piece of its output as text, as it
                comes (plain functions or coroutine functions); bytes that are not UTF-8
                are replaced.
            stdin: what to write to its stdin (bytes, text, or an iterable of bytes,
                sync or async), closed after it; without it, stdin is empty.
            check: raise CommandFailed unless it exits with 0.

        Returns:
            The CommandResult: exit_code, stdout, stderr, status, end_reason, ...

        Raises:
            CommandFailed: with check, it did not exit with 0 (`.result` tells how).
            ProcessError: it could not be started (no such user or directory, ...).
            Forbidden: root asked of a server with --no-root.
            SessionNotFound: the session was closed or expired.
        """
        body = command_body(
            cmd, args=args, cwd=cwd, env=env, user=user, timeout=timeout, stdin=stdin is not None
        )
        if on_stdout is None and on_stderr is None and stdin is None:
            response = await self.client._request(
                "POST",
                self._path,
                json=body,
                session_id=self.session_id,
                timeout=httpx.Timeout(self.client.timeout_s, read=answer_wait_s(timeout)),
            )
            result = CommandResult.from_json(response.json())
        else:
            decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in _NAMES}
            callbacks = {"stdout": on_stdout, "stderr": on_stderr}

            async def text(name: str, data: bytes) -> None:
                await called(callbacks[name], decoders[name].decode(data))

            result = await self.stream(body, on_output=text, stdin=stdin)
        if check and not result.ok:
            raise CommandFailed(result, " ".join([cmd, *args]) if args is not None else cmd)
        return result

    async def stream(
        self,
        body: Mapping[str, Any],
        *,
        on_output: OutputSink,
        stdin: Stdin | None = None,
        on_start: Callable[[int], Any] | None = None,
    ) -> CommandResult:
        """Run a command (`command_body`'s fields) to its end as Server-Sent Events, its
        output's bytes passed to on_output exactly as they come, stdin written as it is
        read. Cancelling this kills the command (the server kills a foreground command
        whose client leaves)."""
        feeding: asyncio.Task[None] | None = None
        wait_s = answer_wait_s(body.get("timeout"))
        try:
            async with (
                translated(self.client.url, self.client.timeout_s, wait_s),
                self.client._http.stream(
                    "POST",
                    self._path,
                    json={**body, **({"stdin": True} if stdin is not None else {})},
                    headers={"Accept": "text/event-stream"},
                    timeout=httpx.Timeout(self.client.timeout_s, read=wait_s),
                ) as response,
            ):
                if not response.is_success:
                    await response.aread()
                    raise self.client._error(response, session_id=self.session_id)
                async for event, data in _sse.events(response.aiter_lines()):
                    if event == "start":
                        pid = int(data["pid"])
                        await called(on_start, pid)
                        if stdin is not None:
                            feeding = asyncio.create_task(self._feed(pid, stdin))
                    elif event in _NAMES:
                        await called(on_output, event, output_bytes(data))
                    elif event == "end":
                        return CommandResult.from_json(data)
                    elif event == "error":
                        raise stream_error(data)
        finally:
            if feeding is not None:
                feeding.cancel()
                await asyncio.gather(feeding, return_exceptions=True)
        raise UnexpectedResponse(
            f"the answer to a command of session {self.session_id} ended before the command "
            f"did; the server at {self.client.url} may have stopped"
        )

    async def _feed(self, pid: int, stdin: Stdin) -> None:
        """Write stdin to a running command, then close it (a command that ended first
        needs no more)."""
        process = self.process(pid)
        try:
            async for chunk in stdin_chunks(stdin):
                await process.send_stdin(chunk)
            await process.close_stdin()
        except errors.ProcessNotFound:
            pass

    async def start(
        self,
        cmd: str,
        *,
        args: Sequence[str] | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the server's limit for the command)
        stdin: bool = False,
        tag: str | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> AsyncProcess:
        """Start a command in the background and answer at once; it runs on while cells
        and other commands run, until it ends or is killed.

        Args:
            cmd, args, cwd, env, user: as for `run`.
            timeout: seconds before its process group is killed (default: none).
            stdin: keep its stdin open, for `process.send_stdin()`.
            tag: a label, shown by `list()`.
            on_stdout, on_stderr: called with its output as it comes, from its first
                byte; `wait()` then answers all of it too. Without them, the process is
                listened to from its first `wait()`, iteration or `attach()` on (what it
                printed before is not heard), and holds no connection meanwhile.

        Returns:
            The AsyncProcess (`.pid`, `.wait()`, `.kill()`, `.send_stdin()`, ...).
        """
        body = command_body(
            cmd,
            args=args,
            cwd=cwd,
            env=env,
            user=user,
            timeout=timeout,
            stdin=stdin,
            background=True,
            tag=tag,
        )
        if on_stdout is None and on_stderr is None:
            response = await self.client._request(
                "POST", self._path, json=body, session_id=self.session_id
            )
            return self.process(int(response.json()["pid"]))
        process = self.process(0)  # its pid comes with its stream's first event
        await process.begin(body, on_stdout=on_stdout, on_stderr=on_stderr)
        return process

    async def list(self) -> builtins.list[ProcessInfo]:
        """The session's running processes (commands and terminals)."""
        response = await self.client._request("GET", self._path, session_id=self.session_id)
        return [ProcessInfo.from_json(item) for item in response.json()["commands"]]

    def process(self, pid: int) -> AsyncProcess:
        """A running process of the session, by pid (as `list()` tells them)."""
        return AsyncProcess(self.client, self.session_id, pid)


_NAMES = ("stdout", "stderr")
