"""The inspector's changes (POST, each with the sign-in's CSRF token): sign in and out, new
sessions, running a cell, interrupt, pause, resume, restart, snapshot, fork, close, snapshots
restored or deleted, cluster nodes drained."""

from __future__ import annotations

import asyncio
import re
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from starlette.responses import RedirectResponse, Response

from cloche.errors import ForkRefused, NodeNotFound, Unauthorized
from cloche.server.ui.pages import NO_CLUSTER, cells_of, history_context, manager_of, pairs
from cloche.server.ui.render import is_htmx, page
from cloche.server.ui.signin import (
    COOKIE,
    CSRF_FIELD,
    LOGIN_COOKIE,
    PREFIX,
    Change,
    SignInNeeded,
    SignIns,
    caller_of_token,
    change,
    check_csrf,
    cookie,
    forget_cookie,
    form_of,
    may_see_cluster,
    needs_token,
    new_secret,
    set_cookie,
    visitor,
)
from cloche.server.ui.throttle import SignInThrottle

router = APIRouter()
QUICK_S = 1.0  # a cell run from the page is waited for this long, to answer with its output
_SAFE_NEXT = re.compile(r"/ui(/[^\\]*)?")


def see_other(path: str, **query: str | list[str]) -> RedirectResponse:
    """303 to a page of the inspector (after a change: reloading it changes nothing)."""
    tail = f"?{urlencode(query, doseq=True)}" if query else ""
    return RedirectResponse(f"{PREFIX}{path}{tail}", status_code=303)


def next_path(request: Request, asked: str | None) -> str:
    """Where to go after signing in: a page of the inspector, never another site."""
    if asked and _SAFE_NEXT.fullmatch(asked) and not asked.startswith("//"):
        return asked
    return f"{PREFIX}/"


def sign_ins_of(request: Request) -> SignIns:
    sign_ins: SignIns = request.app.state.sign_ins
    return sign_ins


@router.get("/login", include_in_schema=False)
async def login_form(request: Request, next: str | None = None) -> Response:  # noqa: A002
    """The sign-in form; on a server without tokens, signed in at once."""
    api = request.app.state.api
    goal = next_path(request, next)
    try:
        visitor(request)
    except SignInNeeded:
        pass
    else:  # signed in already
        return RedirectResponse(goal, status_code=303)
    if not needs_token(api):
        return signed_in(request, None, goal)
    login_csrf = cookie(request, LOGIN_COOKIE) or new_secret()
    response = page(request, "login.html", None, title="Sign in", login_csrf=login_csrf, next=goal)
    set_cookie(request, response, LOGIN_COOKIE, login_csrf)
    return response


@router.post("/login", include_in_schema=False)
async def login(request: Request) -> Response:
    """Check the token as the API would, then sign in with a cookie."""
    form = await form_of(request)
    check_csrf(request, form.get(CSRF_FIELD), cookie(request, LOGIN_COOKIE) or "")
    goal = next_path(request, form.get("next"))
    throttle: SignInThrottle = request.app.state.sign_in_throttle
    host = request.client.host if request.client is not None else None
    throttled = throttle.check(host)
    if throttled is not None:  # the token is not looked at
        whose = "to this server" if throttled.everyone else "from your address"
        refused = f"Too many wrong tokens {whose}: try again in {throttled.retry_after_s} s."
        response = refuse(request, 429, goal, refused)
        response.headers["Retry-After"] = str(throttled.retry_after_s)
        return response
    token = form.get("token", "").strip()
    try:
        caller_of_token(request.app.state.api, token)
    except Unauthorized:
        throttle.refused(host)
        return refuse(request, 401, goal, "That token is not one of this server's.")
    return signed_in(request, token, goal)


def refuse(request: Request, status: int, goal: str, refused: str) -> Response:
    """The sign-in form again, saying why."""
    login_csrf = cookie(request, LOGIN_COOKIE) or ""
    return page(
        request,
        "login.html",
        None,
        status,
        title="Sign in",
        login_csrf=login_csrf,
        next=goal,
        refused=refused,
    )


def signed_in(request: Request, token: str | None, goal: str) -> Response:
    response = RedirectResponse(goal, status_code=303)
    set_cookie(request, response, COOKIE, sign_ins_of(request).add(token))
    forget_cookie(request, response, LOGIN_COOKIE)
    return response


@router.post("/logout", include_in_schema=False)
async def logout(request: Request, _: Change = Depends(change)) -> Response:  # noqa: B008
    sign_ins_of(request).remove(cookie(request, COOKIE) or "")
    response = see_other("/login")
    forget_cookie(request, response, COOKIE)
    return response


@router.post("/sessions", include_in_schema=False)
async def create(request: Request, posted: Change = Depends(change)) -> Response:  # noqa: B008
    profile = posted.form.get("profile") or "lean"
    metadata = pairs(posted.form.get("metadata", ""))
    info = await manager_of(request).create(
        posted.visitor.owner, profile=profile, metadata=metadata
    )
    return see_other(f"/sessions/{info.id}", done="created")


@router.post("/sessions/{session_id}/run", include_in_schema=False)
async def run(
    session_id: str,
    request: Request,
    posted: Change = Depends(change),  # noqa: B008
) -> Response:
    """Run a cell in the background; htmx gets the history, a plain form the page again."""
    manager = manager_of(request)
    owner = posted.visitor.owner
    info = await manager.info(session_id, owner)
    timeouts: dict[str, float] = request.app.state.api.state.session_timeouts
    task = cells_of(request).run(
        manager, info.id, posted.form.get("code", ""), owner, timeouts.get(info.id)
    )
    await asyncio.wait({task}, timeout=QUICK_S)
    if task.done() and (refused := task.result()) is not None:
        raise refused
    if not is_htmx(request):
        return see_other(f"/sessions/{info.id}")
    info = await manager.info(session_id, owner)
    context = await history_context(request, info, posted.visitor)
    return page(request, "_history.html", posted.visitor, **context)


@router.post("/sessions/{session_id}/{verb}", include_in_schema=False)
async def session_verb(
    session_id: str,
    verb: str,
    request: Request,
    posted: Change = Depends(change),  # noqa: B008
) -> Response:
    """interrupt, pause, resume, restart, snapshot, fork or close: then back to a page."""
    manager = manager_of(request)
    owner = posted.visitor.owner
    back = f"/sessions/{session_id}"
    if verb == "interrupt":
        interrupted = await manager.interrupt(session_id, owner)
        return see_other(back, done="interrupted" if interrupted else "not-running")
    if verb == "pause":
        await manager.pause(session_id, owner)
        return see_other(back, done="paused")
    if verb == "resume":
        await manager.resume(session_id, owner)
        return see_other(back, done="resumed")
    if verb == "restart":
        await manager.restart(session_id, owner)
        return see_other(back, done="restarted")
    if verb == "snapshot":
        await manager.snapshot(session_id, owner, posted.form.get("name", "").strip())
        return see_other("/snapshots", done="snapshotted")
    if verb == "fork":
        try:
            count = int(posted.form.get("count") or 1)
        except ValueError:
            raise ForkRefused("count must be a whole number") from None
        copies = await manager.fork(session_id, count, owner)
        return see_other("/", done="forked", copy=[info.id for info in copies])
    if verb == "close":
        await manager.close(session_id, owner, reason="deleted")
        request.app.state.api.state.session_timeouts.pop(session_id, None)
        return see_other("/", done="closed")
    return page(request, "error.html", posted.visitor, 404, title="Not found", message=verb)


@router.post("/snapshots/{snapshot_id}/restore", include_in_schema=False)
async def restore(
    snapshot_id: str,
    request: Request,
    posted: Change = Depends(change),  # noqa: B008
) -> Response:
    info = await manager_of(request).create(posted.visitor.owner, snapshot=snapshot_id)
    return see_other(f"/sessions/{info.id}", done="created")


@router.post("/snapshots/{snapshot_id}/delete", include_in_schema=False)
async def delete_snapshot(
    snapshot_id: str,
    request: Request,
    posted: Change = Depends(change),  # noqa: B008
) -> Response:
    await manager_of(request).delete_snapshot(snapshot_id, posted.visitor.owner)
    return see_other("/snapshots", done="deleted")


@router.post("/cluster/nodes/{node_id}/{verb}", include_in_schema=False)
async def node_verb(
    node_id: str,
    verb: str,
    request: Request,
    posted: Change = Depends(change),  # noqa: B008
) -> Response:
    """drain or resume a node, as POST /v1/cluster/nodes/{id}/drain and /resume."""
    manager = manager_of(request)
    if not may_see_cluster(manager, posted.visitor):
        raise NodeNotFound(NO_CLUSTER)
    if verb == "drain":
        drained = await manager.drain(node_id)
        return page(
            request,
            "cluster.html",
            posted.visitor,
            title="Cluster",
            view=manager.cluster_view(),
            drained=drained,
        )
    if verb == "resume":
        await manager.undrain(node_id)
        return see_other("/cluster", done="undrained")
    return page(request, "error.html", posted.visitor, 404, title="Not found", message=verb)
