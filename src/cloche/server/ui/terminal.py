"""A session's terminal in the inspector: the page that draws it (xterm.js, framed in the
session's page, or alone) and its websocket under /ui, where the sign-in cookie goes.

A browser can't send headers on a websocket, so the socket is checked by what it can send:
its sign-in cookie, the sign-in's CSRF token (a query parameter the page adds) and its
Origin (this server's own, as a browser sets it). Then the API's own bridge carries it
(`serve_terminal`): binary frames both ways, `{"resize"}` from the page, `{"exit"}` at the
shell's end, a refusal closed with 4000 + its HTTP status.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, Request, WebSocket
from starlette.responses import Response

from cloche.errors import ClocheError, Forbidden, Unauthorized
from cloche.server.http.terminals import refuse, serve_terminal
from cloche.server.ui.pages import manager_of
from cloche.server.ui.render import page
from cloche.server.ui.signin import (
    CSRFRefused,
    SignInNeeded,
    Visitor,
    check_csrf,
    visitor,
    visitor_of,
)
from cloche.sessions.manager import SessionManager

router = APIRouter()
# The terminal's document: xterm.js adds <style> elements as it renders, so this page alone
# allows inline styles; scripts are still its own files only, and only the session's page
# (this origin) may frame it.
TERMINAL_CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "form-action 'none'",
        "frame-ancestors 'self'",
        "base-uri 'none'",
    )
)


@router.get("/sessions/{session_id}/terminal", include_in_schema=False)
async def terminal_page(
    session_id: str,
    request: Request,
    who: Visitor = Depends(visitor),  # noqa: B008
) -> Response:
    info = await manager_of(request).info(session_id, who.owner)  # 404 unless the visitor's
    response = page(request, "terminal.html", who, title=f"Terminal of {info.id}", info=info)
    response.headers["content-security-policy"] = TERMINAL_CSP
    return response


@router.websocket("/sessions/{session_id}/pty")
async def terminal_socket(
    websocket: WebSocket,
    session_id: str,
    cols: int = 80,
    rows: int = 24,
    csrf_token: str = "",
) -> None:
    try:
        who = visitor_of(websocket)
        check_csrf(websocket, csrf_token, who.csrf)
        if not same_origin(websocket):
            raise Forbidden("this terminal's socket was opened from another site")
    except SignInNeeded:
        await refuse(websocket, Unauthorized("sign in to the inspector first"))
        return
    except CSRFRefused:
        await refuse(websocket, Forbidden("the socket came without the page's CSRF token"))
        return
    except ClocheError as exc:
        await refuse(websocket, exc)
        return
    manager: SessionManager = websocket.app.state.manager
    await serve_terminal(websocket, manager, session_id, who.owner, cols, rows, None, "ui")


def same_origin(websocket: WebSocket) -> bool:
    """Whether the socket's Origin (set by the browser, not by a page's script) is this
    server as the browser reached it (its Host)."""
    origin = websocket.headers.get("origin", "")
    host = websocket.headers.get("host", "")
    return bool(origin and host) and urlsplit(origin).netloc.lower() == host.lower()
