"""E2B's code interpreter (port 49999): `/execute` as NDJSON, and code contexts.

`POST /execute {"code", "context_id"?, "language"?, "env_vars"?}` answers one JSON object
a line, as E2B's server does: `stdout`/`stderr` `{text, timestamp}` as they happen,
`result` (displays, then the cell's value, `is_main_result`), `error {name, value,
traceback}`, `number_of_executions`, and `end_of_execution` last. A client that goes away
interrupts the cell.

Contexts: the default python context is the session's kernel (IPython syntax as in every
front end: `!pip install ...` of packages the template has succeeds offline). A new python
context runs in that same kernel (it shares its variables: cloche has one interpreter per
session); a bash context runs each cell as a command (`bash -c`, in its cwd: no shell
state is kept between cells). Other languages are a 400 naming those supported.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from cloche.errors import ClocheError, SessionLost, SessionNotFound
from cloche.server.e2b.auth import ENVD, TRAFFIC
from cloche.server.e2b.errors import GONE, E2BError, status_of
from cloche.server.e2b.process import FRONT_END
from cloche.server.e2b.routing import Reach, Where
from cloche.sessions.commands import CommandSpec
from cloche.sessions.result import CellResult

LANGUAGES = ("python", "bash")
HOME = "/home/user"
_MIME = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


class ExecuteIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    code: str = Field(max_length=16 * 1024 * 1024)
    context_id: str | None = None
    language: str | None = None
    env_vars: dict[str, str] | None = None


class ContextIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    language: str | None = None
    cwd: str | None = None


@dataclass(frozen=True)
class Context:
    id: str
    language: str
    cwd: str

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


def language_of(asked: str | None) -> str:
    """Raises E2BError 400 for a language this server can't run."""
    language = (asked or "python").strip().lower()
    if language not in LANGUAGES:
        raise E2BError(
            400,
            f"language {asked!r} is not supported by this server: use one of "
            f"{', '.join(LANGUAGES)}",
        )
    return language


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


def _line(kind: str, **fields: Any) -> bytes:
    return (json.dumps({"type": kind, **fields}, ensure_ascii=False) + "\n").encode()


def result_of(bundle: dict[str, Any], main: bool) -> dict[str, Any]:
    """A MIME bundle as E2B's `Result`."""
    out: dict[str, Any] = {"is_main_result": main}
    extra = {}
    for mime, value in bundle.items():
        name = _MIME.get(mime)
        if name is None:
            extra[mime] = value
        else:
            out[name] = value
    text = out.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        out["text"] = text[1:-1]  # a string's repr, as E2B's server strips it
    if extra:
        out["extra"] = extra
    return out


class Interpreter:
    """The interpreter's routes, over `Reach`; contexts in this server's memory."""

    def __init__(self, reach: Reach) -> None:
        self.reach = reach
        self.contexts: dict[str, dict[str, Context]] = {}  # sandbox id -> id -> context

    def _contexts(self, where: Where) -> dict[str, Context]:
        if where.id not in self.contexts:  # a new sandbox: forget those that are gone
            for gone in [i for i in self.contexts if self.reach.sandboxes.known(i) is None]:
                del self.contexts[gone]
        known = self.contexts.setdefault(where.id, {})
        if not known:
            default = Context(f"python-{where.id[:8]}", "python", HOME)
            known[default.id] = default
        return known

    def _where(self, request: Request, kind: str) -> Where:
        return self.reach.where(request.headers, kind)

    async def execute(self, request: Request) -> Response:
        try:
            where = self._where(request, ENVD)
            try:
                body = ExecuteIn.model_validate_json(await request.body())
            except ValidationError as exc:
                raise E2BError(400, f"invalid request: {exc.errors()[0]['msg']}") from None
            if body.context_id and body.language:
                raise E2BError(400, "Only one of context_id or language can be provided")
            if body.context_id:
                context = self._contexts(where).get(body.context_id)
                if context is None:
                    raise E2BError(404, f"Context {body.context_id} not found")
                language, cwd = context.language, context.cwd
            else:
                language, cwd = language_of(body.language), HOME
            await where.manager.info(where.id, where.owner)  # gone: before the stream
        except (E2BError, ClocheError) as exc:
            return _plain(exc)
        if language == "bash":
            lines = self._bash(where, body.code, cwd, body.env_vars or {})
        else:
            lines = self._python(where, body.code, body.env_vars or {})
        return StreamingResponse(lines, media_type="application/x-ndjson")

    async def _python(self, where: Where, code: str, env: dict[str, str]) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()

        def on_event(event: dict[str, Any]) -> None:
            kind = event.get("type")
            if kind in ("stdout", "stderr"):
                queue.put_nowait(_line(kind, text=event.get("text", ""), timestamp=_now()))
            elif kind == "display" and isinstance(event.get("data"), dict):
                queue.put_nowait(_line("result", **result_of(event["data"], False)))

        async def run() -> CellResult:
            try:
                if env:
                    await _set_env(where, env)
                try:
                    return await where.manager.execute(
                        where.id, code, owner=where.owner, on_event=on_event, front_end=FRONT_END
                    )
                finally:
                    if env:
                        await _set_env(where, {k: None for k in env})
            finally:
                queue.put_nowait(None)

        task = asyncio.ensure_future(run())
        finished = False
        try:
            while (line := await queue.get()) is not None:
                yield line
            try:
                result = await task
            except ClocheError as exc:
                yield _line("error", name=type(exc).__name__, value=str(exc), traceback="")
            else:
                for line in _ending(result):
                    yield line
            finished = True
            yield _line("end_of_execution")
        finally:
            if not finished and not task.done():  # the client went away: stop the cell
                await asyncio.shield(_interrupt(where))

    async def _bash(
        self, where: Where, code: str, cwd: str, env: dict[str, str]
    ) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()

        def on_event(event: dict[str, Any]) -> None:
            if event["type"] in ("stdout", "stderr"):
                text = bytes(event["data"]).decode(errors="replace")
                queue.put_nowait(_line(event["type"], text=text, timestamp=_now()))

        spec = CommandSpec(cmd="/bin/bash", args=("-c", code), cwd=cwd, env=env, timeout_s=0)

        async def run() -> Any:
            try:
                return await where.manager.run_command(
                    where.id, spec, owner=where.owner, on_event=on_event, front_end=FRONT_END
                )
            finally:
                queue.put_nowait(None)

        task = asyncio.ensure_future(run())
        try:
            while (line := await queue.get()) is not None:
                yield line
            try:
                ran = await task
            except ClocheError as exc:
                yield _line("error", name=type(exc).__name__, value=str(exc), traceback="")
            else:
                if ran.exit_code != 0:
                    value = (
                        f"exit code {ran.exit_code}" if ran.exit_code is not None else ran.status
                    )
                    yield _line("error", name="CommandExitError", value=value, traceback=ran.stderr)
            yield _line("end_of_execution")
        finally:
            if not task.done():
                task.cancel()  # the client went away: the command is killed

    # -- contexts --------------------------------------------------------------------------

    async def create_context(self, request: Request) -> Response:
        try:
            where = self._where(request, TRAFFIC)
            raw = await request.body()
            body = ContextIn.model_validate_json(raw or b"{}")
            language = language_of(body.language)
            context = Context(f"{language}-{secrets.token_hex(8)}", language, body.cwd or HOME)
            await where.manager.info(where.id, where.owner)
        except ValidationError as exc:
            return PlainTextResponse(f"invalid request: {exc.errors()[0]['msg']}", 400)
        except (E2BError, ClocheError) as exc:
            return _plain(exc)
        self._contexts(where)[context.id] = context
        return JSONResponse(context.to_json())

    async def list_contexts(self, request: Request) -> Response:
        try:
            where = self._where(request, TRAFFIC)
        except E2BError as exc:
            return _plain(exc)
        return JSONResponse([c.to_json() for c in self._contexts(where).values()])

    async def remove_context(self, request: Request) -> Response:
        try:
            where = self._where(request, TRAFFIC)
            context_id = request.path_params["id"]
            if self._contexts(where).pop(context_id, None) is None:
                raise E2BError(404, f"Context {context_id} not found")
        except E2BError as exc:
            return _plain(exc)
        return Response(status_code=200)

    async def restart_context(self, request: Request) -> Response:
        try:
            where = self._where(request, TRAFFIC)
            context = self._contexts(where).get(request.path_params["id"])
            if context is None:
                raise E2BError(404, f"Context {request.path_params['id']} not found")
            if context.language == "python":
                await where.manager.restart(where.id, where.owner)
        except (E2BError, ClocheError) as exc:
            return _plain(exc)
        return Response(status_code=200)


def _ending(result: CellResult) -> list[bytes]:
    lines = []
    if result.result is not None:
        lines.append(_line("result", **result_of(dict(result.result["data"]), True)))
    if result.error is not None:
        traceback = result.error.get("traceback") or []
        lines.append(
            _line(
                "error",
                name=str(result.error.get("ename", "Error")),
                value=str(result.error.get("evalue", "")),
                traceback="\n".join(traceback) if isinstance(traceback, list) else str(traceback),
            )
        )
    elif result.status.value != "ok":  # a limit, or the sandbox lost: said as an error
        name = {"timeout": "TimeoutError", "interrupted": "KeyboardInterrupt"}.get(
            result.status.value, "SandboxError"
        )
        lines.append(_line("error", name=name, value=result.message or "", traceback=""))
    lines.append(_line("number_of_executions", execution_count=result.execution_count))
    return lines


async def _set_env(where: Where, env: Mapping[str, str | None]) -> None:
    """Set (or, None, unset) variables of the kernel's environment, silently."""
    code = f"import os as _o\nfor _k, _v in {env!r}.items():\n"
    code += "    _o.environ.pop(_k, None) if _v is None else _o.environ.__setitem__(_k, _v)\n"
    await where.manager.execute(where.id, code, owner=where.owner, silent=True)


async def _interrupt(where: Where) -> None:
    try:
        await where.manager.interrupt(where.id, where.owner)
    except ClocheError:
        pass


def _plain(exc: E2BError | ClocheError) -> Response:
    """An error as E2B's interpreter answers: plain text (502 for a sandbox that is gone)."""
    if isinstance(exc, (SessionNotFound, SessionLost)):
        return PlainTextResponse(f"The sandbox {GONE}", 502)
    if isinstance(exc, E2BError):
        return PlainTextResponse(exc.message, exc.status)
    return PlainTextResponse(str(exc), status_of(exc))
