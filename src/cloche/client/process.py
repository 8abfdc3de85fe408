"""A process running in a session (a command started in the background, or one found by
its pid): wait for it, feed it, signal it, kill it, listen to it (`AsyncProcess`), and how
a command ended (`CommandResult`).

Listening is an attach (`GET /v1/sessions/{id}/commands/{pid}`): it hears the output from
the moment it begins, then the process's end; `wait()` and iterating begin it if nothing
has yet, and each hears everything since.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import inspect
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from cloche import errors
from cloche.client import _sse
from cloche.client._errors import translated
from cloche.client._wire import Wire
from cloche.errors import ClocheError, SandboxError, UnexpectedResponse

OutputCallback = Callable[[str], Any]  # called with each piece of stdout or stderr, as text
KEPT_BYTES = 16 << 20  # of each stream, for wait() and iterators; more is dropped (counted)
_NAMES = ("stdout", "stderr")
_EVENTS = {"Accept": "text/event-stream"}
_END_REASONS = {"signaled": "signaled", "killed": "killed", "timeout": "timeout"}


@dataclass(frozen=True)
class CommandResult:
    """A finished command: how it ended and what it printed.

    `exit_code` is set when it exited by itself; otherwise `status` says how it ended
    (`signaled`, `timeout`, `killed`) and `signal` by which signal, when one. Output past
    the server's --output-limit is cut, with a marker saying how much was dropped
    (`end_reason` is then `output_limit`).
    """

    pid: int
    exit_code: int | None
    stdout: str
    stderr: str
    status: str  # exited, signaled, timeout, killed
    end_reason: str  # ok, error, signaled, timeout, killed, output_limit, sandbox_died, paused
    duration_ms: float
    signal: str | None = None  # SIGTERM, ... when a signal ended it

    @property
    def ok(self) -> bool:
        """Whether it exited with 0."""
        return self.exit_code == 0

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> CommandResult:
        code = body.get("exit_code")
        return cls(
            pid=int(body["pid"]),
            exit_code=int(code) if code is not None else None,
            stdout=str(body.get("stdout") or ""),
            stderr=str(body.get("stderr") or ""),
            status=str(body.get("status") or "exited"),
            end_reason=str(body.get("end_reason") or ""),
            duration_ms=float(body.get("duration_ms") or 0.0),
            signal=body.get("signal"),
        )


def output_bytes(data: Mapping[str, Any]) -> bytes:
    """A stdout or stderr event's bytes: text, or base64 where they are not UTF-8."""
    text = str(data.get("data", ""))
    if data.get("encoding") == "base64":
        return base64.b64decode(text)
    return text.encode()


def stream_error(data: Any) -> ClocheError:
    """The exception a stream's `error` event names (its class in the tree, by name)."""
    detail = data if isinstance(data, Mapping) else {}
    kind = getattr(errors, str(detail.get("type", "")), None)
    message = str(detail.get("message") or "the server could not run the command")
    if isinstance(kind, type) and issubclass(kind, ClocheError):
        try:
            return kind(message)
        except TypeError:  # one whose constructor takes something else
            pass
    return SandboxError(message)


async def called(callback: Callable[..., Any] | None, *values: Any) -> None:
    """Call a plain or a coroutine function, if there is one."""
    if callback is not None:
        outcome = callback(*values)
        if inspect.isawaitable(outcome):
            await outcome


class _Attachment:
    """One attach's hearing: the output since it began (up to KEPT_BYTES a stream), and
    the process's end or the attach's failure."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, str]] = []
        self.sizes = dict.fromkeys(_NAMES, 0)
        self.dropped = 0
        self.end: Mapping[str, Any] | None = None
        self.failure: BaseException | None = None
        self.ended = asyncio.Event()
        self.news = asyncio.Condition()
        self.task: asyncio.Task[None] | None = None

    async def hear(self, name: str, raw: bytes, text: str) -> None:
        if self.sizes[name] + len(raw) > KEPT_BYTES:
            self.dropped += len(raw)
            return
        self.sizes[name] += len(raw)
        self.heard.append((name, text))
        async with self.news:
            self.news.notify_all()

    async def finish(self) -> None:
        self.ended.set()
        async with self.news:
            self.news.notify_all()

    def text(self, name: str) -> str:
        return "".join(text for stream, text in self.heard if stream == name)


class AsyncProcess:
    """A process of a session, by its pid. Iterating it yields ("stdout" | "stderr", text),
    what it printed since it was attached and then as it prints, until it ends."""

    def __init__(self, client: Wire, session_id: str, pid: int) -> None:
        self.client = client
        self.session_id = session_id
        self.pid = pid
        self._began = time.perf_counter()
        self._callbacks: dict[str, OutputCallback | None] = {}
        self._attached: _Attachment | None = None

    @property
    def _path(self) -> str:
        return f"/v1/sessions/{quote(self.session_id, safe='')}/commands/{self.pid}"

    async def attach(
        self, *, on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None
    ) -> None:
        """Begin listening (once: later calls only add callbacks): its output from now on
        goes to the callbacks, to iterators and to `wait()`'s result.

        Raises:
            ProcessNotFound: it is not running (and did not end lately).
        """
        await self._attachment(on_stdout, on_stderr)

    async def begin(
        self,
        body: Mapping[str, Any],
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> None:
        """Start the command (`commands.command_body`'s fields, background) listened to
        from its first byte: its pid is known when this returns."""
        await self._attachment(on_stdout, on_stderr, start=body)

    async def _attachment(
        self,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        *,
        start: Mapping[str, Any] | None = None,
    ) -> _Attachment:
        """The attach, begun if need be (with start: the command's start, whose stream
        holds its output from its first byte)."""
        for name, callback in (("stdout", on_stdout), ("stderr", on_stderr)):
            if callback is not None:
                self._callbacks[name] = callback
        if self._attached is not None:
            return self._attached
        attached = _Attachment()
        listening: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        attached.task = asyncio.create_task(self._follow(attached, listening, start))
        self._attached = attached
        try:
            await listening
        except BaseException:
            self._attached = None
            raise
        return attached

    async def _follow(
        self,
        attached: _Attachment,
        listening: asyncio.Future[None],
        start: Mapping[str, Any] | None,
    ) -> None:
        session = f"/v1/sessions/{quote(self.session_id, safe='')}"
        quiet = httpx.Timeout(self.client.timeout_s, read=None)  # a process may say nothing
        asked = (
            self.client._http.stream("GET", self._path, headers=_EVENTS, timeout=quiet)
            if start is None
            else self.client._http.stream(
                "POST", f"{session}/commands", json=start, headers=_EVENTS, timeout=quiet
            )
        )
        try:
            async with translated(self.client.url, self.client.timeout_s), asked as response:
                if not response.is_success:
                    await response.aread()
                    raise self.client._error(response, session_id=self.session_id)
                if start is None:
                    listening.set_result(None)
                await self._take(attached, response, listening)
            if attached.end is None:
                raise UnexpectedResponse(
                    f"the stream of process {self.pid} ended before the process did; the "
                    f"server at {self.client.url} may have stopped"
                )
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if not listening.done():
                listening.set_exception(exc)
            else:
                attached.failure = exc
        finally:
            if not listening.done():
                listening.cancel()
            await attached.finish()

    async def _take(
        self, attached: _Attachment, response: httpx.Response, listening: asyncio.Future[None]
    ) -> None:
        decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in _NAMES}
        async for event, data in _sse.events(response.aiter_lines()):
            if event == "start" and not listening.done():
                self.pid = int(data["pid"])
                listening.set_result(None)
            elif event in _NAMES:
                raw = output_bytes(data)
                text = decoders[event].decode(raw)
                await attached.hear(event, raw, text)
                await called(self._callbacks.get(event), text)
            elif event == "end":
                attached.end = data
                return
            elif event == "error":
                raise stream_error(data)

    async def wait(self, timeout: float | None = None) -> CommandResult:  # noqa: ASYNC109
        """Wait for its end; what it printed meanwhile (since it was attached) and how it
        ended (`duration_ms` as this client saw it: from its start here, or from when it was
        found by its pid).

        Args:
            timeout: seconds to wait at most (None: until it ends).

        Raises:
            TimeoutError: it is still running after timeout (it runs on).
            ProcessNotFound: it is not running (and did not end lately).
        """
        attached = await self._attachment()
        try:
            async with asyncio.timeout(timeout):
                await attached.ended.wait()
        except TimeoutError:
            raise TimeoutError(f"process {self.pid} is still running after {timeout:g} s") from None
        if attached.failure is not None:
            raise attached.failure
        end = attached.end or {}
        code, status = end.get("exit_code"), str(end.get("status") or "killed")
        if code is not None:
            reason = "ok" if code == 0 else "error"
        else:
            reason = _END_REASONS.get(status, "killed")
        if attached.dropped and reason in ("ok", "error"):
            reason = "output_limit"
        return CommandResult(
            pid=self.pid,
            exit_code=int(code) if code is not None else None,
            stdout=attached.text("stdout"),
            stderr=attached.text("stderr"),
            status=status,
            end_reason=reason,
            duration_ms=(time.perf_counter() - self._began) * 1000,
            signal=end.get("signal"),
        )

    def __aiter__(self) -> AsyncIterator[tuple[str, str]]:
        return self._events()

    async def _events(self) -> AsyncIterator[tuple[str, str]]:
        attached = await self._attachment()
        seen = 0

        def news() -> bool:
            return len(attached.heard) > seen or attached.ended.is_set()

        while True:
            async with attached.news:
                await attached.news.wait_for(news)
            while seen < len(attached.heard):
                seen += 1
                yield attached.heard[seen - 1]
            if attached.ended.is_set() and seen == len(attached.heard):
                break
        if attached.failure is not None:
            raise attached.failure

    async def send_stdin(self, data: bytes | str) -> None:
        """Write to its stdin (started with stdin=True; a terminal's input)."""
        if isinstance(data, str):
            body = {"data": data}
        else:
            body = {"data": base64.b64encode(data).decode("ascii"), "encoding": "base64"}
        await self._post("stdin", body)

    async def close_stdin(self) -> None:
        """Close its stdin: it reads the end of its input."""
        await self._post("stdin", {"eof": True})

    async def signal(self, name: str | int) -> None:
        """Send a signal (SIGTERM, TERM, or a number) to its process group."""
        await self._post("signal", {"signal": name})

    async def kill(self) -> None:
        """Kill it and everything it started."""
        await self.client._request("DELETE", self._path, session_id=self.session_id)

    async def _post(self, verb: str, body: dict[str, Any]) -> None:
        await self.client._request(
            "POST", f"{self._path}/{verb}", json=body, session_id=self.session_id
        )

    async def detach(self) -> None:
        """Stop listening (its iterators end); the process runs on. A later `wait()` or
        iteration attaches again."""
        attached, self._attached = self._attached, None
        if attached is not None and attached.task is not None:
            attached.task.cancel()
            await asyncio.gather(attached.task, return_exceptions=True)

    def __repr__(self) -> str:
        return f"<AsyncProcess {self.pid} of session {self.session_id}>"
