"""The inspector (`/ui`): pages in the browser over the same session manager as the API,
and the API's interactive docs (`/docs`) served without a CDN.

The inspector is an app of its own mounted at /ui (its own errors as pages, its own
security headers, nothing in the API's schema); its templates and assets (htmx, Swagger
UI, xterm.js: `static/vendor/README.md`) are package data. A session's terminal is
`terminal.py` (its page and its websocket).
"""

from __future__ import annotations

import html
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, RedirectResponse, Response

from cloche.errors import ClocheError
from cloche.server.http.errors import status_of
from cloche.server.ui import actions, events, pages, terminal
from cloche.server.ui.cells import Cells
from cloche.server.ui.headers import HEADERS, SecurityHeaders
from cloche.server.ui.render import is_htmx, page
from cloche.server.ui.signin import PREFIX, CSRFRefused, SignInNeeded, SignIns, visitor
from cloche.server.ui.throttle import SignInThrottle

log = logging.getLogger("cloche.ui")
STATIC = Path(__file__).parent / "static"
VENDOR = f"{PREFIX}/static/vendor"
# /docs: its own script files only; Swagger UI sets style attributes as it renders.
DOCS_CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    )
)


def mount(api: FastAPI) -> None:
    """Serve the inspector at /ui and the API's docs at /docs (the API made with
    `docs_url=None`, `redoc_url=None`)."""
    api.add_api_route("/docs", _docs(api), include_in_schema=False)
    api.add_api_route(PREFIX, _to_slash, include_in_schema=False)
    api.mount(PREFIX, create(api))


def create(api: FastAPI) -> FastAPI:
    """The inspector's app, over the API app's manager, tokens and background tasks."""
    ui = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    ui.state.api = api  # its token check and its settings
    ui.state.manager = api.state.manager
    ui.state.sign_ins = SignIns()
    ui.state.sign_in_throttle = SignInThrottle()
    ui.state.cells = Cells(api.state.background)
    ui.include_router(pages.router)
    ui.include_router(actions.router)
    ui.include_router(events.router)
    ui.include_router(terminal.router)
    ui.mount("/static", StaticFiles(directory=STATIC), name="static")
    ui.add_middleware(SecurityHeaders)
    _errors(ui)
    return ui


def _docs(api: FastAPI) -> Any:
    openapi = html.escape(api.openapi_url or "/openapi.json", quote=True)
    title = html.escape(f"{api.title} - API docs")
    body = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<link rel="stylesheet" href="{VENDOR}/swagger-ui.css">
<link rel="icon" href="{VENDOR}/favicon-32x32.png">
</head>
<body>
<div id="swagger-ui" data-openapi="{openapi}"></div>
<script src="{VENDOR}/swagger-ui-bundle.js"></script>
<script src="{PREFIX}/static/docs.js"></script>
</body>
</html>
"""

    async def docs() -> HTMLResponse:
        response = HTMLResponse(body)
        response.headers["content-security-policy"] = DOCS_CSP
        for name, value in HEADERS[1:]:  # nosniff, no referrer
            response.headers[name.decode()] = value.decode()
        return response

    return docs


async def _to_slash() -> Response:
    response = RedirectResponse(f"{PREFIX}/", status_code=307)
    for name, value in HEADERS:
        response.headers[name.decode()] = value.decode()
    return response


def _errors(ui: FastAPI) -> None:
    """Failures as pages (a piece of one, for htmx), never the API's JSON."""

    def failed(request: Request, status: int, message: str) -> Response:
        if is_htmx(request):
            return page(request, "_error.html", None, status, message=message)
        try:
            who = visitor(request)  # signed in: the page has its links and sign-out
        except SignInNeeded:
            who = None
        return page(request, "error.html", who, status, title="Error", message=message)

    @ui.exception_handler(SignInNeeded)
    async def sign_in_needed(request: Request, exc: SignInNeeded) -> Response:
        login = f"{PREFIX}/login"
        if is_htmx(request):  # htmx follows this header with a full page load
            return Response(status_code=401, headers={"HX-Redirect": login})
        if request.method == "GET":
            return RedirectResponse(f"{login}?{urlencode({'next': request.url.path})}", 303)
        return RedirectResponse(login, status_code=303)

    @ui.exception_handler(CSRFRefused)
    async def csrf_refused(request: Request, exc: CSRFRefused) -> Response:
        message = "this change came without the page's CSRF token: reload the page, then retry"
        return failed(request, 403, message)

    @ui.exception_handler(ClocheError)
    async def cloche_error(request: Request, exc: ClocheError) -> Response:
        status, _ = status_of(exc)
        if status == 500:
            log.error("inspector request failed: %s", exc)
        return failed(request, status, str(exc))

    @ui.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return failed(request, 400, "invalid request")

    @ui.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return failed(request, exc.status_code, str(exc.detail))
