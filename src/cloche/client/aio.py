"""The client of cloche's HTTP API, written once, async (the sync facade in `sync.py` wraps it).

Example:
    async with cloche.AsyncClient("http://127.0.0.1:8080") as client:
        async with await client.create_session() as session:
            await session.run("x = 41")
            execution = await session.run("x + 1", on_stdout=print)
            print(execution.text)  # 42
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import datetime
import inspect
import json
import os
from collections.abc import AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import Any, Literal
from urllib.parse import quote

import httpx

from cloche.client import _sse
from cloche.client import templates as _templates
from cloche.client._errors import ANSWER_MARGIN_S, cell_refusal, error_for, translated
from cloche.client.execution import Cell, Execution, Result, cell_from_json, execution_from_json
from cloche.errors import ClocheError, SessionNotFound, UnexpectedResponse

DEFAULT_URL = "http://127.0.0.1:8080"

OutputCallback = Callable[[str], Any]  # called with each chunk of stdout or stderr
DisplayCallback = Callable[[Result], Any]  # called with each display()ed bundle or figure
# Called with (prompt, password) when the cell calls input() or getpass(); returns the line
# (a str, or an awaitable of one).
InputCallback = Callable[[str, bool], Any]
FileData = bytes | str  # str is written as UTF-8
RLM_TIMEOUT_S = 3600.0  # how long session.rlm() waits for its answer, by default
HISTORY_PAGE = 1000  # cells asked for at once (the server's most per page)


def default_url() -> str:
    """CLOCHE_URL, else http://127.0.0.1:8080."""
    return os.environ.get("CLOCHE_URL") or DEFAULT_URL


def default_token() -> str | None:
    """CLOCHE_TOKEN (its first entry, when it lists several as `cloche serve` accepts)."""
    tokens = [t.strip() for t in os.environ.get("CLOCHE_TOKEN", "").split(",") if t.strip()]
    return tokens[0] if tokens else None


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    """What the server says about a session."""

    id: str
    profile: str
    state: str  # idle, busy, paused, closing, closed
    created_at: datetime.datetime
    expires_at: datetime.datetime  # when it will be closed if left idle
    execution_count: int
    limits: dict[str, float]  # cell_timeout_s, memory_mib, disk_mib, ...
    egress: dict[str, Any] | None = None  # its egress policy ({policy, allow?}), if any
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)  # its labels
    last_cell: dict[str, Any] | None = None  # {number, end_reason, ended_at}, if it ran any
    cpu_s: float | None = None  # CPU time its sandbox has used (in listings only)
    memory_bytes: int | None = None  # memory its sandbox holds now (in listings only)

    @property
    def cell_timeout_s(self) -> float:
        return float(self.limits.get("cell_timeout_s", 30.0))

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> SessionInfo:
        return cls(
            id=str(body["id"]),
            profile=str(body.get("profile", "lean")),
            state=str(body.get("state", "")),
            created_at=datetime.datetime.fromisoformat(body["created_at"]),
            expires_at=datetime.datetime.fromisoformat(body["expires_at"]),
            execution_count=int(body.get("execution_count", 0)),
            limits=dict(body.get("limits") or {}),
            egress=body.get("egress"),
            metadata={str(k): str(v) for k, v in (body.get("metadata") or {}).items()},
            last_cell=body.get("last_cell"),
            cpu_s=body.get("cpu_s"),
            memory_bytes=body.get("memory_bytes"),
        )


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    """A saved session: restore it with `create_session(snapshot=...)`."""

    id: str
    session_id: str  # the session it was taken of
    name: str
    profile: str
    created_at: datetime.datetime
    size_bytes: int
    execution_count: int

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> SnapshotInfo:
        return cls(
            id=str(body["id"]),
            session_id=str(body["session_id"]),
            name=str(body.get("name", "")),
            profile=str(body.get("profile", "lean")),
            created_at=datetime.datetime.fromisoformat(body["created_at"]),
            size_bytes=int(body.get("size_bytes", 0)),
            execution_count=int(body.get("execution_count", 0)),
        )


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """A file in a session's working directory."""

    path: str
    size_bytes: int
    modified: float  # Unix time, s


def _file_url(path: str) -> str:
    """A working-directory path as URL segments; `.` and `..` escaped so that they reach
    the server (which refuses them) instead of being resolved on the way."""
    segments = [quote(part, safe="") for part in path.split("/")]
    return "/".join(part.replace(".", "%2E") if part in (".", "..") else part for part in segments)


def _encode(data: FileData) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


async def _call(callback: Callable[[Any], Any] | None, value: Any) -> None:
    if callback is not None:
        outcome = callback(value)
        if inspect.isawaitable(outcome):
            await outcome


async def _file_chunks(path: str) -> AsyncIterator[bytes]:
    """A file's content in pieces, read in a thread."""
    file = await asyncio.to_thread(open, path, "rb")
    try:
        while chunk := await asyncio.to_thread(file.read, 1 << 20):
            yield chunk
    finally:
        file.close()


class AsyncClient:
    """A connection to a cloche server's HTTP API.

    Args:
        url: the server's HTTP address; default CLOCHE_URL, else http://127.0.0.1:8080.
        token: the bearer token, when the server has --token; default CLOCHE_TOKEN.
        timeout_s: how long to wait for an answer to anything but a cell (a cell gets
            its own time limit plus a margin).
        transport: an httpx transport to use instead of the network (e.g. ASGITransport).

    Raises (from every method):
        ServerUnreachable: nothing answers at `url`.
        Unauthorized: the server needs a token and `token` is missing or wrong.
        RequestTimeout: no answer within `timeout_s`.
        UnexpectedResponse: `url` is not a cloche server's HTTP port.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = (url or default_url()).rstrip("/")
        self.token = token if token is not None else default_token()
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=timeout_s, transport=transport
        )

    async def create_session(
        self,
        profile: str = "lean",
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the server's limit for cells)
        env: Mapping[str, str] | None = None,
        files: Mapping[str, FileData] | None = None,
        snapshot: str | SnapshotInfo | None = None,
        egress: str | Mapping[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> AsyncSession:
        """A new session.

        Args:
            profile: `lean` (nothing preloaded), `data` (numpy, pandas, matplotlib, scipy
                and sympy preloaded: importing them costs nothing), or one of the server's
                --profiles file.
            timeout: default time limit of its cells, s (at most the server's --cell-timeout).
            env: environment variables to set in it.
            files: files to put in its working directory first, by path.
            snapshot: start from this snapshot (its variables, imports and files) instead;
                the session then has the snapshot's profile.
            egress: network access through the server's egress proxy: the name of one of
                its policies (--egress-policy), or {"policy": name, "allow": [rules]} to
                narrow one. Nothing: the server's `default` policy, if it has one.
            metadata: labels of your choosing (string keys and values, at most 32 pairs and
                4 KiB), to find it by with `list_sessions(metadata=...)`; from a snapshot,
                its session's when left out.

        Raises:
            InvalidMetadata: metadata of the wrong shape or over the limits.
            EgressRefused: an unknown policy, or rules wider than it (403).
            TooManySessions: the server holds --max-sessions sessions already.
            SandboxError: the server could not start a sandbox.
            InvalidRequest: an unknown profile or a bad value.
            SnapshotNotFound: unknown snapshot, or another token's.
            RestoreRefused: the snapshot can't be restored on this server.
        """
        body: dict[str, Any] = {}
        if snapshot is not None:
            body["snapshot"] = snapshot if isinstance(snapshot, str) else snapshot.id
        else:
            body["profile"] = profile
        if timeout is not None:
            body["timeout"] = timeout
        if egress is not None:
            body["egress"] = egress if isinstance(egress, str) else dict(egress)
        if metadata is not None:
            body["metadata"] = dict(metadata)
        if env:
            body["env"] = dict(env)
        if files:
            body["files"] = [
                {"filename": name, "b64_data": base64.b64encode(_encode(data)).decode()}
                for name, data in files.items()
            ]
        response = await self._request("POST", "/v1/sessions", json=body)
        return AsyncSession(self, SessionInfo.from_json(response.json()))

    async def session(self, session_id: str) -> AsyncSession:
        """An existing session, by id.

        Raises:
            SessionNotFound: unknown, closed, expired, or another token's.
        """
        return AsyncSession(self, await self.get_session(session_id))

    async def get_session(self, session_id: str) -> SessionInfo:
        """What the server says about a session now. Raises SessionNotFound."""
        response = await self._request(
            "GET", f"/v1/sessions/{quote(session_id, safe='')}", session_id=session_id
        )
        return SessionInfo.from_json(response.json())

    async def list_sessions(
        self,
        *,
        state: str | None = None,
        profile: str | None = None,
        metadata: Mapping[str, str] | None = None,
        every_tenant: bool = False,
    ) -> list[SessionInfo]:
        """The sessions of this client's token (every session, on a server without tokens).

        Args:
            state: only those in this state: idle, busy or paused.
            profile: only those of this profile.
            metadata: only those carrying every one of these pairs.
            every_tenant: an admin's token: every tenant's sessions (a user's: its own).
        """
        params = {f"metadata.{key}": value for key, value in (metadata or {}).items()}
        if every_tenant:
            params["all"] = "true"
        if state is not None:
            params["state"] = state
        if profile is not None:
            params["profile"] = profile
        response = await self._request("GET", "/v1/sessions", params=params)
        return [SessionInfo.from_json(item) for item in response.json()["sessions"]]

    async def close_session(self, session_id: str) -> None:
        """Close a session. Raises SessionNotFound."""
        await self._request(
            "DELETE", f"/v1/sessions/{quote(session_id, safe='')}", session_id=session_id
        )

    # -- a cluster's nodes (an admin's token) ---------------------------------------------

    async def cluster(self) -> dict[str, Any]:
        """A cluster-mode server's nodes (`GET /v1/cluster`). Raises Forbidden for a user's
        token, NodeNotFound on a single server."""
        response = await self._request("GET", "/v1/cluster")
        view: dict[str, Any] = response.json()
        return view

    async def drain_node(self, node: str, grace_s: float | None = None) -> dict[str, Any]:
        """Move a node's sessions and snapshots to the others (node: its id, or its
        address), for grace_s at most (default the server's --node-grace); the report
        {node, moved, failed, why, snapshots, snapshots_left}."""
        params = {"grace_s": grace_s} if grace_s is not None else {}
        wait = (grace_s or 25.0) + max(self.timeout_s, 60.0)  # the drain answers when done
        response = await self._request(
            "POST",
            f"/v1/cluster/nodes/{quote(node, safe='')}/drain",
            params=params,
            timeout=wait,
        )
        report: dict[str, Any] = response.json()
        return report

    async def resume_node(self, node: str) -> dict[str, Any]:
        """Return a draining node to service."""
        response = await self._request("POST", f"/v1/cluster/nodes/{quote(node, safe='')}/resume")
        answer: dict[str, Any] = response.json()
        return answer

    async def list_snapshots(self) -> list[SnapshotInfo]:
        """The snapshots of this client's token, oldest first."""
        response = await self._request("GET", "/v1/snapshots")
        return [SnapshotInfo.from_json(item) for item in response.json()["snapshots"]]

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        """One snapshot. Raises SnapshotNotFound."""
        response = await self._request(
            "GET", f"/v1/snapshots/{quote(snapshot_id, safe='')}", snapshot_id=snapshot_id
        )
        return SnapshotInfo.from_json(response.json())

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot and its image. Raises SnapshotNotFound."""
        await self._request(
            "DELETE", f"/v1/snapshots/{quote(snapshot_id, safe='')}", snapshot_id=snapshot_id
        )

    # -- templates (`cloche.client.templates`; building and deleting take an admin's token) --

    async def templates(self) -> list[dict[str, Any]]:
        """Every template (the built-in `python` first), each its JSON record."""
        return await _templates.list_all(self)

    async def template(self, name: str) -> dict[str, Any]:
        """One template's record: state, progress, the builder's lines. Raises
        TemplateNotFound."""
        return await _templates.get(self, name)

    async def build_template(
        self,
        name: str,
        *,
        from_tar: str | None = None,
        from_image: str | None = None,
        dockerfile: str | None = None,
        context: str | None = None,
        upload: str | os.PathLike[str] | None = None,
        kind: Literal["tar", "image"] = "tar",
        wait: bool = False,
        wait_timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Build a template: from one source on the server (from_tar, from_image as a REF,
        or dockerfile with its context), or from a local file sent as the body (upload: a
        root filesystem tarball with kind "tar", a `docker save` archive with kind "image").
        Answers at once in state building, unless wait (then when ready).

        Raises:
            Forbidden: the token is not an admin's.
            TemplateExists, TemplateRefused: see the server's message.
            TemplateFailed: with wait, the build failed (the builder's last line).
        """
        built = await _templates.build(
            self,
            name,
            from_tar=from_tar,
            from_image=from_image,
            dockerfile=dockerfile,
            context=context,
            upload=None if upload is None else os.fspath(upload),
            kind=kind,
        )
        return await _templates.wait(self, name, wait_timeout_s) if wait else built

    async def delete_template(self, name: str) -> None:
        """Delete a template. Raises TemplateNotFound, TemplateInUse, Forbidden."""
        await _templates.delete(self, name)

    async def run(
        self,
        code: str,
        *,
        files: Mapping[str, FileData] | None = None,
        profile: str = "lean",
        timeout: float | None = None,  # noqa: ASYNC109 (the server's limit for cells)
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: DisplayCallback | None = None,
    ) -> Execution:
        """Run code once in a fresh session, closed afterwards.

        The files the code created or changed come back in `Execution.output_files`.
        Arguments are those of `create_session` and `AsyncSession.run`.
        """
        session = await self.create_session(profile, files=files)
        try:
            execution = await session.run(
                code,
                timeout=timeout,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                on_display=on_display,
            )
            outputs = {}
            if execution.session_alive:
                for name in execution.files:
                    outputs[name] = await session.download(name)
            return dataclasses.replace(execution, output_files=outputs)
        finally:
            await session.close()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- the wire ---------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        session_id: str | None = None,
        file_path: str | None = None,
        snapshot_id: str | None = None,
        cell_number: int | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One request; a refusal or a failure raised as the tree's exception."""
        async with translated(self.url, self.timeout_s):
            response = await self._http.request(method, path, **kwargs)
        if response.is_success:
            return response
        raise self._error(
            response,
            session_id=session_id,
            file_path=file_path,
            snapshot_id=snapshot_id,
            cell_number=cell_number,
        )

    def _error(
        self,
        response: httpx.Response,
        *,
        session_id: str | None = None,
        file_path: str | None = None,
        snapshot_id: str | None = None,
        cell_number: int | None = None,
    ) -> ClocheError:
        return error_for(
            response,
            url=self.url,
            token=self.token,
            session_id=session_id,
            file_path=file_path,
            snapshot_id=snapshot_id,
            cell_number=cell_number,
        )


class AsyncSession:
    """A live Python interpreter in its own sandbox on the server.

    Variables, imports and files persist from one `run` to the next. Closing it (or
    leaving `async with`) ends it; it also ends by itself after the server's
    --idle-timeout.
    """

    def __init__(self, client: AsyncClient, info: SessionInfo) -> None:
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
            f"{self._path}/files/{_file_url(path)}",
            content=_encode(data),
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
            "GET", f"{self._path}/files/{_file_url(path)}", session_id=self.id, file_path=path
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
            content = _file_chunks(path)
        elif isinstance(context, str | bytes):
            kind = kind or "text"
            content = _encode(context)
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

    async def fork(self, count: int = 1) -> list[AsyncSession]:
        """count independent copies of the session as it is now; this one goes on running.

        Raises:
            TooManySessions: the copies would pass the server's --max-sessions.
            InvalidRequest: count is below 1 or above the server's --max-fork.
        """
        response = await self.client._request(
            "POST", f"{self._path}/fork", json={"count": count}, session_id=self.id
        )
        return [
            AsyncSession(self.client, SessionInfo.from_json(item))
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

    async def refresh(self) -> SessionInfo:
        """What the server says about this session now."""
        self.info = await self.client.get_session(self.id)
        return self.info

    async def close(self) -> None:
        """End the session and its sandbox. Idempotent: an already ended one is fine."""
        if self.closed:
            return
        with contextlib.suppress(SessionNotFound):
            await self.client.close_session(self.id)
        self.closed = True

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncSession {self.id} profile={self.info.profile}>"
