"""The HTTP front end: an ASGI app (FastAPI) on uvicorn, over the shared session manager."""

from cloche.server.http.app import HTTPFrontEnd, create_app

__all__ = ["HTTPFrontEnd", "create_app"]
