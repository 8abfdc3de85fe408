"""The inspector's templates (Jinja2, package data) and how a page is answered."""

from __future__ import annotations

import datetime
import time
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse

from cloche.server.ui.signin import CSRF_FIELD, PREFIX, Visitor, may_see_cluster

DONE = {  # what an action did, told on the page it leads to (never text from the request)
    "created": "Session created.",
    "interrupted": "The running cell was interrupted.",
    "not-running": "No cell was running.",
    "paused": "Paused: saved to disk, its sandbox freed. Any request brings it back.",
    "resumed": "Resumed.",
    "restarted": "Restarted: a fresh interpreter; the files stay.",
    "snapshotted": "Snapshot saved; the session goes on running.",
    "forked": "Forked: the copies are marked below.",
    "closed": "Session closed.",
    "deleted": "Snapshot deleted.",
    "drained": "The node is draining: its sessions moved to the other nodes.",
    "undrained": "The node is back in service.",
}

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("cloche.server.ui", "templates"),
    autoescape=True,  # every value is escaped, in text and in attributes
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def _ago(unix_s: float | None) -> str:
    """How long ago, roughly: 42 s, 7 min, 3 h, 2 d."""
    if unix_s is None:
        return ""
    return _span(max(0.0, time.time() - unix_s))


def _span(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def _iso(unix_s: float | None) -> str:
    if unix_s is None:
        return ""
    moment = datetime.datetime.fromtimestamp(unix_s, datetime.UTC)
    return moment.isoformat(timespec="seconds")


def _mib(size_bytes: float | None) -> str:
    return "" if size_bytes is None else f"{size_bytes / (1 << 20):.1f} MiB"


_ENV.filters.update(ago=_ago, span=_span, iso=_iso, mib=_mib)
_ENV.globals.update(prefix=PREFIX, csrf_field=CSRF_FIELD)


def page(
    request: Request,
    template: str,
    who: Visitor | None,
    status_code: int = 200,
    **context: Any,
) -> HTMLResponse:
    """A template rendered for the visitor (None: not signed in): never cached, as pages
    hold a CSRF token and the visitor's sessions."""
    base = {
        "csrf": who.csrf if who is not None else None,
        "cluster": who is not None and may_see_cluster(request.app.state.manager, who),
        "done": DONE.get(request.query_params.get("done", "")),
    }
    html = _ENV.get_template(template).render(base | context)
    return HTMLResponse(html, status_code, headers={"Cache-Control": "no-store"})


def is_htmx(request: Request) -> bool:
    """Whether htmx asked (it wants a piece of a page, not a whole one)."""
    return request.headers.get("hx-request") == "true"
