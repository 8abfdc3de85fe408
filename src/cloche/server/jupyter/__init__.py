"""The Jupyter kernel gateway front end: jupyter_server's REST API for kernels and their
websocket channels, on the HTTP port, over the same `SessionManager` as the other front ends.

A kernel is a session: its kernel id is the session id (see the spec, jupyter.md).
"""

from __future__ import annotations

from fastapi import FastAPI

from cloche.server.jupyter import channels, rest
from cloche.server.jupyter.kernels import Gateway
from cloche.sessions.manager import SessionManager


def mount(app: FastAPI, manager: SessionManager) -> None:
    """Serve /api (REST) and /api/kernels/{id}/channels (websocket) on app."""
    app.state.jupyter = Gateway(manager, app.state.session_timeouts, app.state.background)
    app.include_router(rest.router)
    app.include_router(channels.router)
