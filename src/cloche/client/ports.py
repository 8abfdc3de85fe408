"""A session's ports, from the SDK: what listens in it, and preview URLs of its servers.

    url = session.ports.url(8000, ttl_s=3600)   # open it in a browser, without a token
    session.ports.list()                        # [8000, ...]

A server a session's command started on its loopback is reached at
`{server}/v1/sessions/{id}/ports/{port}/` with the client's token (`path`), or through a
preview URL by anyone who holds it, until it expires.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cloche.client._wire import Wire

if TYPE_CHECKING:
    from cloche.client._loop import LoopThread


@dataclass(frozen=True)
class PreviewURL:
    """A URL that opens one port of a session without the API's token, until `expires_at`."""

    url: str
    expires_at: datetime.datetime  # UTC

    def __str__(self) -> str:
        return self.url


class AsyncPorts:
    """The ports of one session (`AsyncSession.ports`)."""

    def __init__(self, client: Wire, session_id: str) -> None:
        self._client = client
        self._session_id = session_id

    @property
    def _base(self) -> str:
        return f"/v1/sessions/{self._session_id}/ports"

    def path(self, port: int) -> str:
        """The port's path route on the server (reached with the client's token)."""
        return f"{self._base}/{port}/"

    async def list(self) -> list[int]:
        """The TCP ports something listens on in the session (its loopback, 0.0.0.0, ::).

        Raises:
            SessionNotFound: the session is gone, or another token's.
            PortUnreachable: the session's port relay did not answer.
        """
        answer = await self._client._request("GET", self._base, session_id=self._session_id)
        return [int(entry["port"]) for entry in answer.json()["ports"]]

    async def url(self, port: int, *, ttl_s: int = 3600) -> PreviewURL:
        """A preview URL of a port: it opens that port of this session only, for ttl_s
        seconds (1 to 86400), to whoever holds it; at the server's --preview-domain if it
        has one (`http://{port}-{id}.{domain}/`), else on its path route.

        Raises:
            SessionNotFound: the session is gone, or another token's.
            InvalidRequest: a port or ttl_s out of range.
        """
        answer = await self._client._request(
            "POST",
            f"{self._base}/{int(port)}/url",
            json={"ttl_s": ttl_s},
            session_id=self._session_id,
        )
        body = answer.json()
        return PreviewURL(body["url"], datetime.datetime.fromisoformat(body["expires_at"]))


class Ports:
    """The ports of one session (`Session.ports`), blocking; see `AsyncPorts`."""

    def __init__(self, loop: LoopThread, ports: AsyncPorts) -> None:
        self._loop = loop
        self._async = ports

    def path(self, port: int) -> str:
        return self._async.path(port)

    def list(self) -> list[int]:
        return self._loop.call(self._async.list())

    def url(self, port: int, *, ttl_s: int = 3600) -> PreviewURL:
        return self._loop.call(self._async.url(port, ttl_s=ttl_s))
