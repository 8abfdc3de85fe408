"""The gateway's REST API (jupyter_server's `api.yaml`, the part gateways use): /api,
kernelspecs, and kernels, each kernel a cloche session (its id is the session id).

Kernelspecs: `python3` (the default profile, lean), `cloche-<profile>` for each profile, and
`cloche-template-<name>` for each ready template but the built-in `python` (a kernel of one
is a session of that template; a template's sessions are lean).
"""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict

from cloche import __version__
from cloche.errors import ClocheError, PathRefused, UnknownProfile
from cloche.packages.profiles import BUILT_IN
from cloche.sandbox.images import TemplateState
from cloche.server.http.auth import gateway_owner
from cloche.server.http.errors import error_response, status_of
from cloche.server.jupyter.kernels import Gateway
from cloche.server.metrics import Metrics
from cloche.sessions.manager import SessionManager
from cloche.sessions.profiles import LEAN
from cloche.sessions.session import SessionInfo, SessionState
from cloche.sessions.templates import BUILT_IN as BUILT_IN_TEMPLATE

DEFAULT_SPEC = "python3"  # the server's default profile, lean
SPEC_PREFIX = "cloche-"  # and every profile as cloche-<profile>
TEMPLATE_PREFIX = "cloche-template-"  # and every template as cloche-template-<name>


class _CountedRoute(APIRoute):
    """A route whose requests are counted in cloche_jupyter_requests, by status."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        route = self.path

        async def counted(request: Request) -> Response:
            metrics: Metrics = request.app.state.metrics
            try:
                response = await handler(request)
            except ClocheError as exc:
                metrics.jupyter_requests.labels(route, str(status_of(exc)[0])).inc()
                raise
            except RequestValidationError:
                metrics.jupyter_requests.labels(route, "400").inc()
                raise
            metrics.jupyter_requests.labels(route, str(response.status_code)).inc()
            return response

        return counted


# Out of cloche's OpenAPI schema: these follow jupyter_server's (api.yaml), clients' contract.
router = APIRouter(
    prefix="/api", tags=["jupyter"], route_class=_CountedRoute, include_in_schema=False
)


async def owner_of(request: Request) -> str | None:
    """The caller's token, in any of the ways Jupyter's clients send one."""
    return gateway_owner(request)


class KernelCreate(BaseModel):
    """POST /api/kernels: what jupyter_server's clients send (more is ignored)."""

    model_config = ConfigDict(extra="ignore")
    name: str | None = None
    path: str | None = None  # a path on the client's machine: ignored
    env: dict[str, str] | None = None


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.jupyter
    return gateway


def spec_name(profile: str, template: str = BUILT_IN_TEMPLATE) -> str:
    if template != BUILT_IN_TEMPLATE:
        return TEMPLATE_PREFIX + template
    return DEFAULT_SPEC if profile == LEAN.name else SPEC_PREFIX + profile


def session_of(spec: str | None) -> tuple[str, str | None]:
    """The profile and template (None: the built-in) a kernelspec name stands for. A
    template's name wins over a profile named `template-<name>`.

    Raises:
        UnknownProfile: not a kernelspec of this server.
    """
    if spec is None or spec == DEFAULT_SPEC:
        return LEAN.name, None
    if spec.startswith(TEMPLATE_PREFIX) and len(spec) > len(TEMPLATE_PREFIX):
        return LEAN.name, spec.removeprefix(TEMPLATE_PREFIX)
    if spec.startswith(SPEC_PREFIX) and len(spec) > len(SPEC_PREFIX):
        return spec.removeprefix(SPEC_PREFIX), None
    raise UnknownProfile(
        f"no kernelspec {spec!r}: this server has {DEFAULT_SPEC!r}, '{SPEC_PREFIX}<profile>' "
        f"for each profile and '{TEMPLATE_PREFIX}<name>' for each template "
        "(GET /api/kernelspecs)"
    )


def _timestamp(unix_s: float) -> str:
    """As jupyter_server writes (and its gateway client parses) last_activity."""
    moment = datetime.datetime.fromtimestamp(unix_s, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def kernel_model(gateway: Gateway, info: SessionInfo) -> dict[str, Any]:
    busy = info.state is SessionState.BUSY or gateway.busy(info.id)
    return {
        "id": info.id,
        "name": spec_name(info.profile, info.template),
        "last_activity": _timestamp(info.last_active),
        "execution_state": "busy" if busy else "idle",  # a paused session is idle
        "connections": gateway.connections(info.id),
    }


def _kernelspec(name: str, display_name: str, **cloche: str) -> dict[str, Any]:
    return {
        "name": name,
        "spec": {
            "argv": [],
            "display_name": display_name,
            "language": "python",
            "interrupt_mode": "message",
            "env": {},
            "metadata": {"cloche": cloche} if cloche else {},
        },
        "resources": {},
    }


async def _kernelspecs(manager: SessionManager) -> dict[str, dict[str, Any]]:
    describe = getattr(manager, "profiles", None)
    rows = await asyncio.to_thread(describe) if describe is not None else []
    names = [row["name"] for row in rows if row["state"] != "failed"] or list(BUILT_IN)
    specs = {DEFAULT_SPEC: _kernelspec(DEFAULT_SPEC, f"Python 3 (cloche {LEAN.name})")}
    for profile in names:
        name = SPEC_PREFIX + profile
        specs[name] = _kernelspec(name, f"Python 3 (cloche {profile})", profile=profile)
    for template in await manager.templates():
        if template.name == BUILT_IN_TEMPLATE or template.state is not TemplateState.READY:
            continue
        name = TEMPLATE_PREFIX + template.name
        python = f"Python {template.python_version or 3}"
        shown = f"{python} (cloche template {template.name})"
        specs[name] = _kernelspec(name, shown, profile=LEAN.name, template=template.name)
    return specs


@router.get("", summary="The gateway's version")
async def api_version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/kernelspecs", summary="One kernelspec per session profile")
async def list_kernelspecs(
    request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    specs = await _kernelspecs(request.app.state.manager)
    return {"default": DEFAULT_SPEC, "kernelspecs": specs}


@router.get("/kernelspecs/{name}", summary="One kernelspec")
async def get_kernelspec(
    name: str, request: Request, owner: str | None = Depends(owner_of)
) -> Response:
    specs = await _kernelspecs(request.app.state.manager)
    if name not in specs:
        return error_response(404, "not_found", f"no kernelspec {name!r} (GET /api/kernelspecs)")
    return JSONResponse(specs[name])


@router.get("/kernels", summary="The caller's kernels (its sessions)")
async def list_kernels(
    request: Request, owner: str | None = Depends(owner_of)
) -> list[dict[str, Any]]:
    gateway = _gateway(request)
    return [kernel_model(gateway, info) for info in await gateway.manager.sessions(owner)]


@router.post("/kernels", status_code=201, summary="Start a kernel (a new session)")
async def start_kernel(
    request: Request, body: KernelCreate | None = None, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    body = body or KernelCreate()
    gateway = _gateway(request)
    manager = gateway.manager
    profile, template = session_of(body.name)
    info = await manager.create(owner, profile=profile, template=template)
    # KERNEL_* are the gateway client's own metadata (KERNEL_WORKING_DIR is a path on its
    # machine, say): not the kernel's environment.
    env = {k: v for k, v in (body.env or {}).items() if not k.startswith("KERNEL_")}
    if env:
        try:
            await _set_env(manager, info.id, owner, env)
        except BaseException:
            await manager.close(info.id, owner, reason="failed-setup")
            raise
    return kernel_model(gateway, await manager.info(info.id, owner))


async def _set_env(
    manager: SessionManager, session_id: str, owner: str | None, env: dict[str, str]
) -> None:
    """Set environment variables in a session, as the sessions API does: a silent cell.

    Raises:
        PathRefused: the interpreter refused them (a NUL in a value, say).
    """
    setup = f"import os\nos.environ.update({json.dumps(env)})"
    result = await manager.execute(session_id, setup, owner=owner, silent=True)
    if result.status.value != "ok":
        why = result.error["evalue"] if result.error else result.message
        raise PathRefused("env", f"could not set the environment: {why}")


@router.get("/kernels/{kernel_id}", summary="One kernel")
async def get_kernel(
    kernel_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    gateway = _gateway(request)
    return kernel_model(gateway, await gateway.manager.info(kernel_id, owner))


@router.delete("/kernels/{kernel_id}", status_code=204, summary="Shut a kernel down")
async def delete_kernel(
    kernel_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> Response:
    gateway = _gateway(request)
    await gateway.manager.close(kernel_id, owner, reason="deleted")
    request.app.state.session_timeouts.pop(kernel_id, None)
    gateway.closed(kernel_id)
    return Response(status_code=204)


@router.post("/kernels/{kernel_id}/restart", summary="A fresh interpreter, same kernel id")
async def restart_kernel(
    kernel_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> dict[str, Any]:
    gateway = _gateway(request)
    return kernel_model(gateway, await gateway.restart(kernel_id, owner))


@router.post("/kernels/{kernel_id}/interrupt", status_code=204, summary="Interrupt the cell")
async def interrupt_kernel(
    kernel_id: str, request: Request, owner: str | None = Depends(owner_of)
) -> Response:
    await _gateway(request).manager.interrupt(kernel_id, owner)
    return Response(status_code=204)
