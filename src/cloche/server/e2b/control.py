"""E2B's control plane (`E2B_API_URL`): sandboxes made, found, listed, timed, paused, ended.

Both the paths SDK 2.x calls (`/v2/sandboxes`, `/v2/sandboxes/{id}/connect`) and the
unversioned ones older SDKs call are served. Bodies are E2B's (camelCase); fields this
server does not use are accepted and ignored, as E2B's API does for newer SDKs.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import json
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from cloche.config import Limits
from cloche.errors import ClocheError, EgressRefused, SnapshotNotFound
from cloche.server.e2b import network
from cloche.server.e2b.auth import api_caller
from cloche.server.e2b.errors import E2BError, error_json, from_exception
from cloche.server.e2b.sandboxes import (
    DEFAULT_TIMEOUT_S,
    ENVD_VERSION,
    MAX_TIMEOUT_S,
    Sandbox,
    Sandboxes,
    template_of,
)
from cloche.sessions.manager import SessionManager
from cloche.sessions.session import SessionInfo, SessionState

Handler = Callable[[Request], Awaitable[Response]]
MAX_PAGE = 1000


class NewSandbox(BaseModel):
    """POST /sandboxes and /v2/sandboxes."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    template_id: str = Field(alias="templateID", max_length=256)
    timeout: int | None = Field(default=None, ge=0, le=MAX_TIMEOUT_S)
    auto_pause: bool = Field(default=False, alias="autoPause")
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(default=None, alias="envVars")
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None
    mcp: dict[str, Any] | None = None
    volume_mounts: list[Any] | None = Field(default=None, alias="volumeMounts")


class Timeout(BaseModel):
    model_config = ConfigDict(extra="allow")
    timeout: int | None = Field(default=None, ge=0, le=MAX_TIMEOUT_S)


class Resume(Timeout):
    auto_pause: bool | None = Field(default=None, alias="autoPause")


class Refresh(BaseModel):
    model_config = ConfigDict(extra="allow")
    duration: int | None = Field(default=None, ge=0, le=MAX_TIMEOUT_S)


class SnapshotAsk(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str | None = Field(default=None, max_length=256)


class ForkAsk(Timeout):
    count: int | None = Field(default=None, ge=1, le=64)


def _iso(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).isoformat()


async def _body(request: Request, model: type[BaseModel], required: bool = True) -> Any:
    raw = await request.body()
    if not raw and not required:
        return model.model_validate({})
    try:
        return model.model_validate(json.loads(raw or b"null"))
    except (ValueError, ValidationError) as exc:
        problems = (
            "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
            )
            if isinstance(exc, ValidationError)
            else "the body is not JSON"
        )
        raise E2BError(400, f"invalid request: {problems}") from None


class ControlPlane:
    """The routes, over a manager and this server's E2B sandboxes."""

    def __init__(self, manager: SessionManager, sandboxes: Sandboxes, limits: Limits) -> None:
        self.manager = manager
        self.sandboxes = sandboxes
        self.limits = limits
        route = self._route
        self.router = Router(
            [
                route("/sandboxes", self.create, "POST"),
                route("/v2/sandboxes", self.create, "POST"),
                route("/sandboxes", self.list_v1, "GET"),
                route("/v2/sandboxes", self.list_v2, "GET"),
                route("/sandboxes/{id}", self.info, "GET"),
                route("/sandboxes/{id}", self.kill, "DELETE"),
                route("/sandboxes/{id}/timeout", self.timeout, "POST"),
                route("/sandboxes/{id}/refreshes", self.refresh, "POST"),
                route("/sandboxes/{id}/pause", self.pause, "POST"),
                route("/sandboxes/{id}/resume", self.resume, "POST"),
                route("/sandboxes/{id}/connect", self.connect, "POST"),
                route("/v2/sandboxes/{id}/connect", self.connect, "POST"),
                route("/sandboxes/{id}/snapshots", self.snapshot, "POST"),
                route("/sandboxes/{id}/fork", self.fork, "POST"),
                route("/snapshots", self.snapshots, "GET"),
                route("/templates/{id:path}", self.delete_snapshot, "DELETE"),
                *(
                    Route(path, _unsupported(what), methods=[method])
                    for method, path, what in UNSUPPORTED
                ),
            ],
            default=no_route,
        )

    def _route(self, path: str, handler: Handler, method: str) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except (E2BError, ClocheError) as exc:
                return from_exception(exc)

        return Route(path, endpoint, methods=[method])

    # -- the shapes ------------------------------------------------------------------------

    def created(self, info: SessionInfo, sandbox: Sandbox) -> dict[str, Any]:
        """E2B's `Sandbox`: what create, connect and resume answer."""
        return {
            "templateID": sandbox.template_id,
            "sandboxID": info.id,
            "clientID": "cloche",
            "alias": sandbox.template_id,
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": self.sandboxes.envd_token(info.id),
            "trafficAccessToken": self.sandboxes.traffic_token(info.id),
            "domain": None,
        }

    def listed(self, info: SessionInfo, sandbox: Sandbox) -> dict[str, Any]:
        """E2B's `ListedSandbox`."""
        return {
            "templateID": sandbox.template_id,
            "alias": sandbox.template_id,
            "sandboxID": info.id,
            "clientID": "cloche",
            "startedAt": _iso(info.created_at),
            "endAt": _iso(sandbox.end_at),
            "cpuCount": max(1, int(self.limits.cpu_quota or 1)),
            "memoryMB": self.limits.memory_mib,
            "diskSizeMB": self.limits.disk_mib,
            "state": self.sandboxes.state(info),
            "envdVersion": ENVD_VERSION,
            "metadata": info.metadata,
        }

    def detail(self, info: SessionInfo, sandbox: Sandbox) -> dict[str, Any]:
        """E2B's `SandboxDetail`."""
        return {
            **self.listed(info, sandbox),
            "envdAccessToken": self.sandboxes.envd_token(info.id),
            "domain": None,
            "allowInternetAccess": info.egress is not None,
        }

    async def _find(self, request: Request) -> tuple[str | None, SessionInfo, Sandbox]:
        owner = api_caller(request).token
        info = await self.manager.info(request.path_params["id"], owner)
        return owner, info, self.sandboxes.of(info, owner)

    # -- the routes ------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        owner = api_caller(request).token
        body: NewSandbox = await _body(request, NewSandbox)
        if body.volume_mounts:
            raise E2BError(400, "volumeMounts are not supported by this server yet")
        if body.mcp:
            raise E2BError(400, "mcp servers are not supported by this server yet")
        timeout = body.timeout or DEFAULT_TIMEOUT_S
        try:
            snapshot = await self.manager.get_snapshot(body.template_id, owner)
        except SnapshotNotFound:
            snapshot = None
        if snapshot is not None:
            info = await self.manager.create(
                owner, snapshot=snapshot.id, metadata=body.metadata or None
            )
        else:
            template, profile = template_of(body.template_id)
            egress = network.egress_of(body.allow_internet_access, body.network)

            async def make(asked: Any) -> SessionInfo:
                return await self.manager.create(
                    owner,
                    profile,
                    egress=asked,
                    metadata=body.metadata or None,
                    template=template,
                    env=body.env_vars or None,
                )

            if egress == network.NOTHING:
                try:  # the default policy narrowed to nothing
                    info = await make({"allow": []})
                except EgressRefused:  # there is no default policy: no egress is the default
                    info = await make(None)
            else:
                info = await make(egress)
        sandbox = self.sandboxes.add(info, owner, body.template_id, timeout, body.auto_pause)
        return JSONResponse(self.created(info, sandbox), status_code=201)

    async def _listed(self, request: Request) -> list[tuple[SessionInfo, Sandbox]]:
        owner = api_caller(request).token
        query = request.query_params
        labels = {}
        if query.get("metadata"):
            for key, value in urllib.parse.parse_qsl(query["metadata"], keep_blank_values=True):
                labels[urllib.parse.unquote(key)] = urllib.parse.unquote(value)
        infos = await self.manager.sessions(owner, metadata=labels)
        found = [(info, self.sandboxes.of(info, owner)) for info in infos]
        states = {s for s in (query.get("state") or "").split(",") if s}
        if states - {"running", "paused"}:
            raise E2BError(400, f"state: running or paused, not {query['state']!r}")
        if states:
            found = [pair for pair in found if self.sandboxes.state(pair[0]) in states]
        if query.get("template"):
            found = [pair for pair in found if pair[1].template_id == query["template"]]
        if query.get("startedAfter"):
            try:
                after = datetime.datetime.fromisoformat(query["startedAfter"]).timestamp()
            except ValueError:
                raise E2BError(400, "startedAfter: an ISO 8601 time") from None
            found = [pair for pair in found if pair[0].created_at >= after]
        order = query.get("order") or "asc"
        if order not in ("asc", "desc"):
            raise E2BError(400, f"order: asc or desc, not {order!r}")
        found.sort(key=lambda pair: (pair[0].created_at, pair[0].id), reverse=order == "desc")
        return found

    async def list_v1(self, request: Request) -> Response:
        found = await self._listed(request)
        return JSONResponse([self.listed(info, sandbox) for info, sandbox in found])

    async def list_v2(self, request: Request) -> Response:
        found = await self._listed(request)
        start, limit = _page(request.query_params.get("nextToken"), request.query_params)
        page = found[start : start + limit]
        headers = {}
        if start + limit < len(found):
            headers["x-next-token"] = _token(start + limit)
        body = [self.listed(info, sandbox) for info, sandbox in page]
        return JSONResponse(body, headers=headers)

    async def info(self, request: Request) -> Response:
        _, info, sandbox = await self._find(request)
        return JSONResponse(self.detail(info, sandbox))

    async def kill(self, request: Request) -> Response:
        owner, info, _ = await self._find(request)
        await self.manager.close(info.id, owner, reason="deleted")
        self.sandboxes.forget(info.id)
        return Response(status_code=204)

    async def timeout(self, request: Request) -> Response:
        _, _, sandbox = await self._find(request)
        body: Timeout = await _body(request, Timeout)
        if body.timeout is None:
            raise E2BError(400, "invalid request: timeout is required (seconds)")
        self.sandboxes.set_timeout(sandbox, body.timeout)
        return Response(status_code=204)

    async def refresh(self, request: Request) -> Response:
        _, _, sandbox = await self._find(request)
        body: Refresh = await _body(request, Refresh, required=False)
        self.sandboxes.set_timeout(sandbox, body.duration or DEFAULT_TIMEOUT_S)
        return Response(status_code=204)

    async def pause(self, request: Request) -> Response:
        owner, info, sandbox = await self._find(request)
        if sandbox.paused and info.state is SessionState.PAUSED:
            raise E2BError(409, f"sandbox {info.id} is already paused")
        await self.manager.pause(info.id, owner)
        sandbox.paused = True
        return Response(status_code=204)

    async def _wake(self, request: Request, model: type[Timeout], conflict: bool) -> Response:
        owner, info, sandbox = await self._find(request)
        body = await _body(request, model, required=False)
        was_paused = sandbox.paused or info.state is SessionState.PAUSED
        if conflict and not was_paused:
            raise E2BError(409, f"sandbox {info.id} is already running")
        if was_paused:
            info = await self.manager.resume(info.id, owner)
        sandbox.paused = False
        if isinstance(body, Resume) and body.auto_pause is not None:
            sandbox.auto_pause = body.auto_pause
        if body.timeout or was_paused:
            self.sandboxes.set_timeout(sandbox, body.timeout or DEFAULT_TIMEOUT_S)
        return JSONResponse(self.created(info, sandbox), status_code=201 if was_paused else 200)

    async def connect(self, request: Request) -> Response:
        return await self._wake(request, Timeout, conflict=False)

    async def resume(self, request: Request) -> Response:
        response = await self._wake(request, Resume, conflict=True)
        response.status_code = 201
        return response

    async def snapshot(self, request: Request) -> Response:
        owner, info, _ = await self._find(request)
        body: SnapshotAsk = await _body(request, SnapshotAsk, required=False)
        record = await self.manager.snapshot(info.id, owner, name=body.name or "")
        names = [record.name] if record.name else []
        return JSONResponse({"snapshotID": record.id, "names": names}, status_code=201)

    async def snapshots(self, request: Request) -> Response:
        owner = api_caller(request).token
        records = await self.manager.snapshots(owner)
        query = request.query_params
        if query.get("sandboxID"):
            records = [r for r in records if r.session_id == query["sandboxID"]]
        if query.get("name"):
            records = [r for r in records if r.name == query["name"]]
        start, limit = _page(query.get("nextToken"), query)
        headers = {"x-next-token": _token(start + limit)} if start + limit < len(records) else {}
        body = [
            {"snapshotID": r.id, "names": [r.name] if r.name else []}
            for r in records[start : start + limit]
        ]
        return JSONResponse(body, headers=headers)

    async def delete_snapshot(self, request: Request) -> Response:
        owner = api_caller(request).token
        try:
            await self.manager.delete_snapshot(request.path_params["id"], owner)
        except SnapshotNotFound:
            raise E2BError(404, f"template {request.path_params['id']!r} not found") from None
        return Response(status_code=204)

    async def fork(self, request: Request) -> Response:
        owner, info, sandbox = await self._find(request)
        body: ForkAsk = await _body(request, ForkAsk, required=False)
        copies = await self.manager.fork(info.id, body.count or 1, owner)
        answers = []
        for copy in copies:
            made = self.sandboxes.add(
                copy, owner, sandbox.template_id, body.timeout or DEFAULT_TIMEOUT_S
            )
            answers.append({"sandbox": self.created(copy, made)})
        return JSONResponse(answers, status_code=201)


# What E2B's API has and cloche does not serve yet: 501, naming it.
UNSUPPORTED = (
    ("GET", "/sandboxes/metrics", "sandbox metrics"),
    ("GET", "/sandboxes/{id}/metrics", "sandbox metrics (see cloche's /metrics)"),
    ("GET", "/sandboxes/{id}/logs", "sandbox logs"),
    ("GET", "/v2/sandboxes/{id}/logs", "sandbox logs"),
    ("PUT", "/sandboxes/{id}/network", "changing a running sandbox's network"),
    ("GET", "/templates", "E2B templates (see cloche's /v1/templates)"),
    ("POST", "/templates", "building E2B templates (see cloche templates build)"),
    ("POST", "/v2/templates", "building E2B templates (see cloche templates build)"),
    ("POST", "/v3/templates", "building E2B templates (see cloche templates build)"),
    ("GET", "/secrets", "secrets (see cloche's --secrets)"),
    ("POST", "/secrets", "secrets (see cloche's --secrets)"),
    ("GET", "/volumes", "volumes"),
    ("POST", "/volumes", "volumes"),
)


def _unsupported(what: str) -> Handler:
    async def answer(request: Request) -> Response:
        return error_json(501, f"{what} is not supported by this cloche server yet")

    return answer


async def no_route(scope: Any, receive: Any, send: Any) -> None:
    """A path E2B's API does not have: 404 in its error shape."""
    message = f"{scope.get('method')} {scope.get('path')} is not part of E2B's API as served here"
    await error_json(404, message)(scope, receive, send)


def _token(offset: int) -> str:
    return base64.urlsafe_b64encode(str(offset).encode()).decode()


def _page(token: str | None, query: Any) -> tuple[int, int]:
    """(first index, page size) from nextToken and limit."""
    start = 0
    if token:
        try:
            start = int(base64.urlsafe_b64decode(token.encode()).decode())
        except (binascii.Error, ValueError, UnicodeDecodeError):
            raise E2BError(400, "nextToken: not a token this server gave") from None
    try:
        limit = int(query.get("limit") or 100)
    except ValueError:
        raise E2BError(400, "limit: a whole number") from None
    if not 1 <= limit <= MAX_PAGE or start < 0:
        raise E2BError(400, f"limit: 1 to {MAX_PAGE}")
    return start, limit
