"""A sandbox request's way to its session: which sandbox, whose, as which user.

E2B's SDKs send every sandbox request to one URL with `E2b-Sandbox-Id` and
`E2b-Sandbox-Port`; host-based routing (`{port}-{id}.{domain}`) reaches the same apps
through `E2B.sandbox_app(id, port)`, which sets the id as that header.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext

from cloche.errors import ClocheError, SessionLost, SessionNotFound
from cloche.server.e2b.auth import ENVD, sandbox_of
from cloche.server.e2b.errors import GONE, E2BError, connect_error
from cloche.server.e2b.sandboxes import Sandboxes
from cloche.sessions.manager import SessionManager

T = TypeVar("T")
ENVD_PORT = 49983
INTERPRETER_PORT = 49999


@dataclass(frozen=True)
class Where:
    """The session a request acts on, for whom, and as which user of the sandbox."""

    manager: SessionManager
    id: str
    owner: str | None
    user: str | None


def user_of(authorization: str | None) -> str | None:
    """The user of `Authorization: Basic base64(user:)` (envd's way); None: the default."""
    scheme, _, value = (authorization or "").partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded.split(":", 1)[0] or None


class Reach:
    """Finds a request's sandbox from its headers, its token checked."""

    def __init__(self, manager: SessionManager, sandboxes: Sandboxes) -> None:
        self.manager = manager
        self.sandboxes = sandboxes

    def where(self, headers: Mapping[str, str], kind: str = ENVD) -> Where:
        """Raises E2BError (502 gone, 401 token)."""
        sandbox_id = headers.get("e2b-sandbox-id") or ""
        offered = headers.get("x-access-token" if kind == ENVD else "e2b-traffic-access-token")
        sandbox = sandbox_of(self.sandboxes, sandbox_id, offered, kind)
        return Where(self.manager, sandbox.id, sandbox.owner, user_of(headers.get("authorization")))

    def __call__(self, ctx: RequestContext[Any, Any]) -> Where:
        """For a Connect service: raises ConnectError."""
        try:
            return self.where(ctx.request_headers)
        except E2BError as exc:
            code = Code.UNAVAILABLE if exc.status == 502 else Code.UNAUTHENTICATED
            raise ConnectError(code, exc.message) from None


async def call(awaitable: Awaitable[T]) -> T:
    """Await a manager's verb, its errors as envd's Connect errors."""
    try:
        return await awaitable
    except (SessionNotFound, SessionLost) as exc:
        raise ConnectError(Code.UNAVAILABLE, f"The sandbox {GONE} ({exc})") from None
    except ClocheError as exc:
        raise connect_error(exc) from None


class Checked:
    """A codec of connectrpc's whose undecodable input is INVALID_ARGUMENT (connectrpc lets
    the decoder's own error through: a 500)."""

    def __init__(self, inner: Codec[Any, Any]) -> None:
        self.inner = inner

    def name(self) -> str:
        return self.inner.name()

    def encode(self, message: Any) -> bytes:
        return self.inner.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self.inner.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as exc:  # any decoder's failure: the request is malformed
            what = message_class.__name__
            raise ConnectError(Code.INVALID_ARGUMENT, f"not a valid {what}: {exc}") from None


CODECS: list[Codec[Any, Any]] = [Checked(proto_binary_codec()), Checked(proto_json_codec())]
