"""Who may call: the API key on the control plane, the sandbox's tokens on its own routes.

The control plane takes `X-API-KEY` (or `Authorization: Bearer`): a cloche token, whose
tenant owns the sandboxes it makes; its quotas and egress ceiling apply. A sandbox's routes
(envd, the code interpreter) carry no key: they are reached by the sandbox's id
(`E2b-Sandbox-Id`) with its `X-Access-Token` (envd, /execute) or `E2B-Traffic-Access-Token`
(/contexts), as E2B's own do, and act for the sandbox's owner.
"""

from __future__ import annotations

from starlette.requests import HTTPConnection

from cloche.server.e2b.errors import GONE, E2BError
from cloche.server.e2b.sandboxes import Sandbox, Sandboxes
from cloche.server.tenants import Caller, Tenants

ENVD = "envd"
TRAFFIC = "traffic"


def api_caller(connection: HTTPConnection) -> Caller:
    """The caller of a control-plane request.

    Raises:
        E2BError: 401, no key or a wrong one on a server with tokens.
    """
    tenants: Tenants = connection.app.state.tenants
    key = connection.headers.get("x-api-key")
    if not key:
        scheme, _, token = connection.headers.get("authorization", "").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else None
    caller = tenants.caller(key or None)
    if caller is None:
        raise E2BError(
            401,
            "Invalid API key: E2B_API_KEY must be a token of this cloche server "
            "(--token, --tokens)",
        )
    connection.state.caller = caller
    return caller


def sandbox_of(
    sandboxes: Sandboxes, sandbox_id: str, offered: str | None, kind: str = ENVD
) -> Sandbox:
    """The sandbox a request is routed to, its token checked.

    Raises:
        E2BError: 502 "was not found" for a sandbox this server does not know (gone, or
            never reached through E2B); 401 for a missing or wrong token.
    """
    sandbox = sandboxes.known(sandbox_id)
    if sandbox is None:
        raise E2BError(502, f"The sandbox {sandbox_id} {GONE}")
    if not sandboxes.check(kind, sandbox_id, offered):
        header = "X-Access-Token" if kind == ENVD else "E2B-Traffic-Access-Token"
        raise E2BError(401, f"{header} is missing or wrong for sandbox {sandbox_id}")
    return sandbox
