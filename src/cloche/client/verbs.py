"""What a session does on the server: run cells, hold files and a context, answer with an
RLM, save and copy itself, install packages, tell its history, run commands and open
terminals (`AsyncSession`'s verbs).

Its client is reached through `Wire` (`AsyncClient` is one), so that the verbs live here,
below the client that makes sessions (`aio.py`).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, Self
from urllib.parse import quote

import httpx

from cloche.client import _sse
from cloche.client._errors import ANSWER_MARGIN_S, cell_refusal, translated
from cloche.client._files import FileData, encode, file_chunks, file_url
from cloche.client._wire import Wire
from cloche.client.commands import AsyncCommands
from cloche.client.execution import Cell, Execution, Result, cell_from_json, execution_from_json
from cloche.client.info import FileInfo, SessionInfo, SnapshotInfo
from cloche.client.terminal import AsyncTerminal
from cloche.errors import UnexpectedResponse

OutputCallback = Callable[[str], Any]  # called with each chunk of stdout or stderr
DisplayCallback = Callable[[Result], Any]  # called with each display()ed bundle or figure
# Called with (prompt, password) when the cell calls input() or getpass(); returns the line
# (a str, or an awaitable of one).
InputCallback = Callable[[str, bool], Any]
RLM_TIMEOUT_S = 3600.0  # how long session.rlm() waits for its answer, by default
HISTORY_PAGE = 1000  # cells asked for at once (the server's most per page)


async def _call(callback: Callable[[Any], Any] | None, value: Any) -> None:
    if callback is not None:
        outcome = callback(value)
        if inspect.isawaitable(outcome):
            await outcome


class SessionVerbs:
    """The verbs of a session (see `AsyncSession`), through its client's wire."""

    def __init__(self, client: Wire, info: SessionInfo) -> None:
        self.client = client
        self.info = info
        self.closed = False

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def metadata(self) -> dict[str, str]:
        """Its labels, as last told (made, fetched, refreshed or updated)."""
        return self.info.metadata

    @property
    def _path(self) -> str:
        return f"/v1/sessions/{quote(self.id, safe='')}"

    @functools.cached_property
    def commands(self) -> AsyncCommands:
        """Its commands: `run` one to its end, `start` one in the background, `list` those
        running (`cloche.client.commands`)."""
        return AsyncCommands(self.client, self.id)

    async def pty(self, cols: int = 80, rows: int = 24, cmd: str | None = None) -> AsyncTerminal:
        """Open a terminal: a login shell of the session's user (or cmd, a command line run
        in it) on a pseudo-terminal of cols x rows. Close it (or leave `async with`) to
        hang the shell up.

        Raises (from the terminal's first read or write, when refused):
            SessionNotFound: the session was closed or expired.
            ProcessError: the shell could not be started.
            NotSupported: the server offers no terminals (a cluster's front end).
        """
        return await AsyncTerminal.open(
            self.client.url,
            self.client.token,
            self.id,
            cols=cols,
            rows=rows,
            cmd=cmd,
            timeout_s=self.client.timeout_s,
        )

    async def run(
        self,
        code: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the server's limit for cells)
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: DisplayCallback | None = None,
        on_input: InputCallback | None = None,
    ) -> Execution:
        """Run a cell; its outcome, including any exception the code raised.

        Output is streamed as it happens: the callbacks (plain functions or coroutine
        functions) are called in order, while the cell runs. Cancelling the call stops
        the cell (the server interrupts a cell whose client went away).

        Args:
            code: Python source; the value of a last expression is the result.
            timeout: time limit of this cell, s (at most the server's --cell-timeout);
                past it the cell is interrupted and `status` is `timeout`.
            on_stdout: called with each chunk written to stdout.
            on_stderr: called with each chunk written to stderr.
            on_display: called with each `display()`ed object or matplotlib figure.
            on_input: called with (prompt, password) when the cell calls input() or
                getpass(); what it returns is the line the cell gets. Without it, input()
                raises StdinNotImplementedError in the cell. The cell's time limit runs on
                while it waits.

        Returns:
            The Execution: results, logs, error, status, duration_ms, ...

        Raises:
            SessionNotFound: the session was closed or expired.
            SessionBusy: too many cells already wait in this session.
            RequestTimeout: no answer within the cell's time limit plus a margin.
        """
        body: dict[str, Any] = {"code": code}
        if timeout is not None:
            body["timeout"] = timeout
        if on_input is not None:
            body["allow_stdin"] = True
        wait_s = (timeout or self.info.cell_timeout_s) + ANSWER_MARGIN_S
        error: dict[str, Any] | None = None
        done: dict[str, Any] | None = None
        async with (
            translated(self.client.url, self.client.timeout_s, wait_s),
            self.client._http.stream(
                "POST",
                f"{self._path}/execute",
                json=body,
                headers={"Accept": "text/event-stream"},
                timeout=httpx.Timeout(self.client.timeout_s, read=wait_s),
            ) as response,
        ):
            if not response.is_success:
                await response.aread()
                raise self.client._error(response, session_id=self.id)
            async for event, data in _sse.events(response.aiter_lines()):
                if event == "stdout":
                    await _call(on_stdout, data["text"])
                elif event == "stderr":
                    await _call(on_stderr, data["text"])
                elif event == "display":
                    await _call(on_display, Result(dict(data)))
                elif event == "input_request" and on_input is not None:
                    await self._answer(on_input, str(data["prompt"]), data["password"] is True)
                elif event == "error":
                    error = data  # the code's exception, or why the server could not run it
                elif event == "done" and data is not None:
                    done = data  # the stream ends here: read to its end, leave nothing open
        if done is not None:
            return execution_from_json(done, session_id=self.id)
        if error is not None and not error.get("traceback"):  # refused: it never ran
            raise cell_refusal(error, self.id)
        raise UnexpectedResponse(
            f"the answer to a cell of session {self.id} ended before the cell did; "
            f"the server at {self.client.url} may have stopped"
        )

    async def _answer(self, on_input: InputCallback, prompt: str, password: bool) -> None:
        value = on_input(prompt, password)
        if inspect.isawaitable(value):
            value = await value
        # A 409 (no input() waits any more: the cell was interrupted or timed out meanwhile)
        # changes nothing here: the cell's own end, in the stream, says what happened.
        async with translated(self.client.url, self.client.timeout_s):
            await self.client._http.post(f"{self._path}/input", json={"value": str(value)})

    async def upload(self, path: str, data: FileData) -> None:
        """Write a file in the working directory (directories on the way are made).

        Raises:
            PathRefused: the path leads out of the working directory, or is unusable.
        """
        await self.client._request(
            "PUT",
            f"{self._path}/files/{file_url(path)}",
            content=encode(data),
            session_id=self.id,
            file_path=path,
        )

    async def download(self, path: str) -> bytes:
        """A file of the working directory.

        Raises:
            PathNotFound: nothing is there.
            PathRefused: the path leads out of the working directory.
        """
        response = await self.client._request(
            "GET", f"{self._path}/files/{file_url(path)}", session_id=self.id, file_path=path
        )
        return response.content

    async def list_files(self) -> list[FileInfo]:
        """The files of the working directory, recursively."""
        response = await self.client._request("GET", f"{self._path}/files", session_id=self.id)
        return [
            FileInfo(path=f["path"], size_bytes=int(f["size_bytes"]), modified=float(f["modified"]))
            for f in response.json()["files"]
        ]

    async def set_context(
        self, context: Any, *, kind: Literal["text", "json"] | None = None
    ) -> int:
        """Put a context in the session as the variable `context`.

        It is streamed to a file in the working directory (not through a cell), so it may
        be as large as the working directory (the server's --disk-mib), and loaded silently.

        Args:
            context: Text (a str, or UTF-8 bytes); a path (`pathlib.Path`), whose file is
                streamed, as JSON when its name ends in .json; or any other JSON value.
            kind: "text" or "json", instead of the guess.

        Returns:
            Its size in bytes.

        Raises:
            PathRefused: it is larger than the working directory, or the session could not
                load it (not JSON, or too large for its memory).
        """
        content: Any
        if isinstance(context, os.PathLike):
            path = os.fspath(context)
            kind = kind or ("json" if str(path).endswith(".json") else "text")
            content = file_chunks(path)
        elif isinstance(context, str | bytes):
            kind = kind or "text"
            content = encode(context)
        else:
            kind = "json"
            content = json.dumps(context, ensure_ascii=False).encode()
        response = await self.client._request(
            "PUT",
            f"{self._path}/context",
            params={"format": kind},
            content=content,
            session_id=self.id,
            timeout=max(self.client.timeout_s, self.info.cell_timeout_s + ANSWER_MARGIN_S),
        )
        return int(response.json()["size_bytes"])

    async def rlm(
        self,
        query: str,
        *,
        context: Any = None,
        model: str | None = None,
        timeout_s: float = RLM_TIMEOUT_S,
    ) -> str:
        """Answer query with a Recursive Language Model over this session's `context`.

        The server's root model writes code that runs in this session and calls sub-models
        on pieces of `context` with llm_query, until it answers (the server's
        POST /v1/chat/completions with model rlm:<model>). The session keeps the run's
        variables for the next cells and runs.

        Args:
            query: The question.
            context: Put in the session first, as `set_context` does; None keeps the
                session's own.
            model: The model of the root and of llm_query; None for the server's --llm-model.
            timeout_s: How long to wait for the answer.

        Returns:
            The answer.

        Raises:
            LLMUnavailable: the server has no LLM backend.
            LLMBudgetExceeded: the session spent one of its LLM budgets.
            LLMError: the model's endpoint failed.
        """
        if context is not None:
            await self.set_context(context)
        body = {"model": f"rlm:{model or ''}", "messages": [{"role": "user", "content": query}]}
        response = await self.client._request(
            "POST",
            "/v1/chat/completions",
            json=body,
            headers={"x-cloche-session-id": self.id},
            session_id=self.id,
            timeout=timeout_s,
        )
        return str(response.json()["choices"][0]["message"]["content"])

    async def snapshot(self, name: str = "") -> SnapshotInfo:
        """Save the session as it is now (after its running cell); it goes on running.

        Raises:
            StorageFull: the server's --data-dir is full.
            CheckpointFailed: the server could not save it.
        """
        response = await self.client._request(
            "POST", f"{self._path}/snapshot", json={"name": name}, session_id=self.id
        )
        return SnapshotInfo.from_json(response.json())

    async def fork(self, count: int = 1) -> list[Self]:
        """count independent copies of the session as it is now; this one goes on running.

        Raises:
            TooManySessions: the copies would pass the server's --max-sessions.
            InvalidRequest: count is below 1 or above the server's --max-fork.
        """
        response = await self.client._request(
            "POST", f"{self._path}/fork", json={"count": count}, session_id=self.id
        )
        return [
            type(self)(self.client, SessionInfo.from_json(item))
            for item in response.json()["sessions"]
        ]

    async def pause(self) -> SessionInfo:
        """Save the session to disk and free its memory; its next use resumes it."""
        response = await self.client._request("POST", f"{self._path}/pause", session_id=self.id)
        self.info = SessionInfo.from_json(response.json())
        return self.info

    async def resume(self) -> SessionInfo:
        """Bring a paused session back now (running a cell does so by itself)."""
        response = await self.client._request("POST", f"{self._path}/resume", session_id=self.id)
        self.info = SessionInfo.from_json(response.json())
        return self.info

    async def install(self, *packages: str) -> list[dict[str, str]]:
        """Install packages into the session, as `%pip install` in a cell would.

        The server fetches wheels (the sandbox has no network) and unpacks them into the
        session's site directory; the session's next cells can import them.

        Args:
            packages: pip requirements by name and version, e.g. "humanize==4.*".

        Returns:
            [{"name", "version"}] of the packages installed (those the session already
            had are not listed).

        Raises:
            PackageInstallError: refused by the server's policy, unknown, no wheel for
                the sandbox, or over the server's --package-max-mib.
        """
        response = await self.client._request(
            "POST", f"{self._path}/packages", session_id=self.id, json={"packages": list(packages)}
        )
        return [dict(item) for item in response.json()["installed"]]

    async def interrupt(self) -> bool:
        """Interrupt the running cell (KeyboardInterrupt in it); False when none was running."""
        response = await self.client._request("POST", f"{self._path}/interrupt", session_id=self.id)
        return bool(response.json()["interrupted"])

    async def history(self, after: int = 0, limit: int | None = None) -> list[Cell]:
        """The cells the session has run, oldest first, as its history keeps them.

        The server keeps a session's last --history-cells cells (200 by default), their
        stdout and stderr each cut to --history-output-bytes; pause, snapshot, fork and
        restarts keep them. Cells sent by any front end are there (`Cell.front_end`).

        Args:
            after: only cells numbered above this (the last `Cell.number` seen, to page).
            limit: at most this many; None for all that are kept.

        Returns:
            The cells, each with its code, times and outcome (`Cell.execution`).

        Raises:
            SessionNotFound: unknown, closed, or another token's.
        """
        cells: list[Cell] = []
        while limit is None or len(cells) < limit:
            page = HISTORY_PAGE if limit is None else min(HISTORY_PAGE, limit - len(cells))
            response = await self.client._request(
                "GET",
                f"{self._path}/cells",
                params={"after": after, "limit": page},
                session_id=self.id,
            )
            found = [cell_from_json(item, self.id) for item in response.json()["cells"]]
            cells.extend(found)
            if len(found) < page:
                break
            after = found[-1].number
        return cells

    async def cell(self, number: int) -> Cell:
        """One cell of the session's history, by its `Cell.number`.

        Raises:
            CellNotFound: no cell of that number is kept (never run, or no longer kept).
            SessionNotFound: unknown, closed, or another token's.
        """
        response = await self.client._request(
            "GET", f"{self._path}/cells/{int(number)}", session_id=self.id, cell_number=number
        )
        return cell_from_json(response.json(), self.id)

    async def update_metadata(self, changes: Mapping[str, str | None]) -> SessionInfo:
        """Merge changes into the session's metadata: a str sets its key, None deletes it.

        Returns:
            What the server says about the session now (`info.metadata`: all its labels).

        Raises:
            InvalidMetadata: the result would not be string pairs within the limits (at
                most 32 pairs, 4 KiB); the session keeps the metadata it had.
        """
        response = await self.client._request(
            "PATCH", self._path, json={"metadata": dict(changes)}, session_id=self.id
        )
        self.info = SessionInfo.from_json(response.json())
        return self.info
