"""Bearer tokens: who is asking, when the server has tokens."""

from __future__ import annotations

import hmac

from fastapi import Request

from cloche.errors import Unauthorized


async def owner_of(request: Request) -> str | None:
    """The dependency behind every route: `bearer_owner`. (A plain `def` dependency would
    run in a worker thread on every request; the hand-off costs more than the check.)"""
    return bearer_owner(request)


def bearer_owner(request: Request) -> str | None:
    """The caller's token (the owner of the sessions it makes), or None without tokens.

    Raises:
        Unauthorized: tokens are configured and the request has no valid one.
    """
    tokens: frozenset[str] = request.app.state.tokens
    if not tokens:
        return None
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() == "bearer" and token:
        for known in tokens:
            if hmac.compare_digest(known.encode(), token.encode()):
                return known
    raise Unauthorized("this server needs 'Authorization: Bearer <token>' with a valid token")
