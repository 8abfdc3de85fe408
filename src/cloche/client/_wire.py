"""What a session's verbs need of the client that holds it: its HTTP connection, and its
requests with their failures raised as the tree's exceptions (`AsyncClient` is one)."""

from __future__ import annotations

from typing import Any, Protocol

import httpx

from cloche.errors import ClocheError


class Wire(Protocol):
    """The client side of the HTTP API, as `AsyncClient` offers it to its sessions."""

    url: str
    token: str | None
    timeout_s: float
    _http: httpx.AsyncClient

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
    ) -> httpx.Response: ...

    def _error(
        self,
        response: httpx.Response,
        *,
        session_id: str | None = None,
        file_path: str | None = None,
        snapshot_id: str | None = None,
        cell_number: int | None = None,
    ) -> ClocheError: ...
