"""A session's ports, as front ends reach them: every manager has these verbs; one that
can't serve them (a cluster's front end, for now) says so (NotSupported).

A port is reached for the length of a block (`reach_port`): the session is resumed if
paused and thawed if frozen, and counts as in use (not frozen, paused or closed for
idleness) until the block ends. The owner is a token, as for every verb, or, for a preview
token that holds no API token, the key its sessions are recorded under (`OwnerKey`).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from cloche.errors import NotSupported
from cloche.network.ports.door import Link, PortDoor

_NOT_HERE = "ports are not offered by this server (a cluster's front end)"


@dataclass(frozen=True)
class OwnerKey:
    """An owner known by the key its sessions are recorded under (a preview token's)."""

    key: str | None


Owner = str | OwnerKey | None


@dataclass(frozen=True)
class PortTarget:
    """One port of a session's sandbox, reached through its ports door."""

    session_id: str
    port: int
    door: PortDoor

    async def connect(self, first: bytes = b"") -> Link:
        """A connection to the port (a kept-alive one if the server left one), first sent.

        Raises:
            PortUnreachable: nothing listens on it, or the sandbox's relay does not answer.
        """
        return await self.door.connect(self.port, first)


class PortVerbs(abc.ABC):  # noqa: B024  # every verb has a default: it says it can't
    """All raise SessionNotFound for an unknown session or another owner's."""

    async def ports(self, session_id: str, owner: Owner = None) -> list[int]:
        """The TCP ports something listens on in the session's sandbox (its loopback, and
        the wildcard addresses), cloche's own egress proxy left out.

        Raises:
            PortUnreachable: the sandbox's port relay does not answer.
        """
        raise NotSupported(_NOT_HERE)

    def reach_port(
        self, session_id: str, port: int, owner: Owner = None
    ) -> AbstractAsyncContextManager[PortTarget]:
        """Reach a port of the session for the length of a block (see the module).

        Raises:
            Forbidden: the port is the session's egress proxy (cloche's own).
        """
        return _refused()


@contextlib.asynccontextmanager
async def _refused() -> AsyncIterator[PortTarget]:
    raise NotSupported(_NOT_HERE)
    yield  # pragma: no cover


class ForwardedPortVerbs(PortVerbs):
    """The port verbs of a manager that wraps another (`inner`): passed on as they are."""

    @property
    def _port_verbs(self) -> PortVerbs:
        inner: PortVerbs = getattr(self, "inner")  # noqa: B009  # the wrapper's own
        return inner

    async def ports(self, *args: Any, **kwargs: Any) -> list[int]:
        return await self._port_verbs.ports(*args, **kwargs)

    def reach_port(self, *args: Any, **kwargs: Any) -> AbstractAsyncContextManager[PortTarget]:
        return self._port_verbs.reach_port(*args, **kwargs)
