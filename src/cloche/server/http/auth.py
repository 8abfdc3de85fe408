"""Bearer tokens: who is asking, when the server has tokens."""

from __future__ import annotations

import hmac

from fastapi import Request
from starlette.requests import HTTPConnection

from cloche.errors import Unauthorized


async def owner_of(request: Request) -> str | None:
    """The dependency behind every route: `bearer_owner`. (A plain `def` dependency would
    run in a worker thread on every request; the hand-off costs more than the check.)"""
    return bearer_owner(request)


def bearer_owner(request: HTTPConnection) -> str | None:
    """The caller's token (the owner of the sessions it makes), or None without tokens.

    Raises:
        Unauthorized: tokens are configured and the request has no valid one.
    """
    tokens: frozenset[str] = request.app.state.tokens
    if not tokens:
        return None
    scheme, token = _authorization(request)
    known = _known(tokens, token) if scheme == "bearer" else None
    if known is None:
        raise Unauthorized("this server needs 'Authorization: Bearer <token>' with a valid token")
    return known


def gateway_owner(connection: HTTPConnection) -> str | None:
    """As `bearer_owner`, in the ways Jupyter's clients send a token: `Authorization:
    token <t>` or `bearer <t>`, or `?token=<t>` (websocket clients often can only do that).

    Raises:
        Unauthorized: tokens are configured and the request has no valid one.
    """
    tokens: frozenset[str] = connection.app.state.tokens
    if not tokens:
        return None
    scheme, token = _authorization(connection)
    known = _known(tokens, token) if scheme in ("bearer", "token") else None
    if known is None:
        known = _known(tokens, connection.query_params.get("token", ""))
    if known is None:
        raise Unauthorized(
            "this server needs a valid token: 'Authorization: token <t>' (or bearer), or ?token=<t>"
        )
    return known


def _authorization(connection: HTTPConnection) -> tuple[str, str]:
    """(scheme in lower case, credentials) of the Authorization header."""
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    return scheme.lower(), token.strip()


def _known(tokens: frozenset[str], token: str) -> str | None:
    """The configured token equal to token (compared in constant time), or None."""
    if not token:
        return None
    found = None
    for known in tokens:
        if hmac.compare_digest(known.encode(), token.encode()):
            found = known
    return found
