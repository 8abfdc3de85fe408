"""Bearer tokens: who is asking, in which role, when the server has tokens.

Each check leaves the caller (`cloche.server.tenants.Caller`: token, tenant, role, quotas)
on `request.state.caller`; `caller_of` is the dependency that answers it, `can_see_all`
whether the caller may see every tenant's sessions (an admin, or a server without tokens).
"""

from __future__ import annotations

from fastapi import Request
from starlette.requests import HTTPConnection

from cloche.errors import Forbidden, Unauthorized
from cloche.server.tenants import Caller, Tenants


async def owner_of(request: Request) -> str | None:
    """The dependency behind every route: `bearer_owner`. (A plain `def` dependency would
    run in a worker thread on every request; the hand-off costs more than the check.)"""
    return bearer_caller(request).token


async def caller_of(request: Request) -> Caller:
    """The dependency for routes that look at the caller's role or tenant."""
    return bearer_caller(request)


def bearer_owner(request: HTTPConnection) -> str | None:
    """The caller's token (the owner of the sessions it makes), or None without tokens.

    Raises:
        Unauthorized: tokens are configured and the request has no valid one.
    """
    return bearer_caller(request).token


def bearer_caller(connection: HTTPConnection) -> Caller:
    """Who sent the request, by its `Authorization: Bearer <token>`.

    Raises:
        Unauthorized: tokens are configured and the request has no valid one.
    """
    tenants: Tenants = connection.app.state.tenants
    scheme, token = _authorization(connection)
    caller = tenants.caller(token if scheme == "bearer" else None)
    if caller is None:
        raise Unauthorized("this server needs 'Authorization: Bearer <token>' with a valid token")
    connection.state.caller = caller
    return caller


def gateway_owner(connection: HTTPConnection) -> str | None:
    """As `bearer_owner`, in the ways Jupyter's clients send a token: `Authorization:
    token <t>` or `bearer <t>`, or `?token=<t>` (websocket clients often can only do that).

    Raises:
        Unauthorized: tokens are configured and the request has no valid one.
    """
    return gateway_caller(connection).token


def gateway_caller(connection: HTTPConnection) -> Caller:
    """As `bearer_caller`, with the token as Jupyter's clients send it (`gateway_owner`).

    Raises:
        Unauthorized: tokens are configured and the request has no valid one.
    """
    tenants: Tenants = connection.app.state.tenants
    scheme, token = _authorization(connection)
    caller = tenants.caller(token) if scheme in ("bearer", "token") else None
    if caller is None:
        caller = tenants.caller(connection.query_params.get("token"))
    if caller is None:
        raise Unauthorized(
            "this server needs a valid token: 'Authorization: token <t>' (or bearer), or ?token=<t>"
        )
    connection.state.caller = caller
    return caller


def can_see_all(connection: HTTPConnection) -> bool:
    """Whether the caller may see every tenant's sessions (and their events): an admin, or
    anyone on a server without tokens. Checks the bearer token if no check ran yet.

    Raises:
        Unauthorized: tokens are configured and the request has no valid one.
    """
    caller: Caller | None = getattr(connection.state, "caller", None)
    return (caller or bearer_caller(connection)).sees_all


def require_admin(caller: Caller, what: str) -> None:
    """Raises Forbidden unless the caller is an admin; what: "view the cluster", say."""
    if not caller.is_admin:
        raise Forbidden(
            f"only an admin may {what}: tenant {caller.name!r} has the role 'user' (an "
            'admin\'s token is given with --admin-token, or role = "admin" in --tokens)'
        )


def _authorization(connection: HTTPConnection) -> tuple[str, str]:
    """(scheme in lower case, credentials) of the Authorization header."""
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    return scheme.lower(), token.strip()
