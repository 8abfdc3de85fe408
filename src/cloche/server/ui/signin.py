"""Signing in to the inspector: a token, checked as the API checks a bearer token, kept on
the server behind a random cookie, with a CSRF token of its own per sign-in.

The browser holds only the sign-in's id (HttpOnly, SameSite=Strict, Path=/ui, Secure over
https), signed by the server (`cloche.server.signing`, as preview tokens are): a cookie the
server did not set, or set too long ago, is refused before anything is looked up. The token
and the CSRF token stay in this process's memory, so a restart signs everybody out. A server
without tokens is open, as its API is: a visit signs in at once, still with a CSRF token, so
a change can't be forged from another site.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

from starlette.requests import HTTPConnection, Request
from starlette.responses import Response
from starlette.types import ASGIApp

from cloche.errors import Unauthorized
from cloche.server.http.auth import bearer_caller
from cloche.server.signing import BadSignature, Signer
from cloche.server.tenants import Caller

if TYPE_CHECKING:
    from cloche.sessions.manager import SessionManager

PREFIX = "/ui"
COOKIE = "cloche_ui"
LOGIN_COOKIE = "cloche_ui_login"  # the login form's own CSRF token (double-submitted)
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
IDLE_S = 12 * 3600.0  # a sign-in unused this long is forgotten
MAX_SIGN_INS = 10_000  # the oldest-used go first beyond this
MAX_FORM_FIELDS = 100


class SignInNeeded(Exception):
    """The request has no valid sign-in: it is sent to /ui/login."""


class CSRFRefused(Exception):
    """A change came without the sign-in's CSRF token (403)."""


@dataclass
class SignIn:
    """One browser's sign-in."""

    token: str | None  # what the API's check takes; None on a server without tokens
    csrf: str
    used_at: float  # monotonic, s


@dataclass(frozen=True)
class Visitor:
    """Who a request to the inspector comes from: the API's caller, and its sign-in's CSRF
    token."""

    caller: Caller  # as the API's `bearer_caller` answers for the token signed in with
    csrf: str

    @property
    def owner(self) -> str | None:
        """The owner of the sessions, as the session manager is told."""
        return self.caller.token


def caller_of_token(api: ASGIApp, token: str | None) -> Caller:
    """The caller a bearer token makes, by the API's own check (`bearer_caller`).

    Raises:
        Unauthorized: the server has tokens, and this is not one of them.
    """
    headers: list[tuple[bytes, bytes]] = []
    if token is not None:
        try:
            headers.append((b"authorization", b"Bearer " + token.encode("latin-1")))
        except UnicodeEncodeError:
            raise Unauthorized("not a valid token") from None
    scope = {"type": "http", "app": api, "headers": headers, "query_string": b"", "path": "/"}
    return bearer_caller(HTTPConnection(scope))


def needs_token(api: ASGIApp) -> bool:
    """Whether the server has tokens (else the inspector is open, as the API is)."""
    try:
        caller_of_token(api, None)
    except Unauthorized:
        return True
    return False


def new_secret() -> str:
    """A random id or CSRF token: 256 bits from the OS's CSPRNG, URL-safe."""
    return secrets.token_urlsafe(32)


class SignIns:
    """The sign-ins of this server, by the random id in their cookie."""

    def __init__(self) -> None:
        self._by_id: OrderedDict[str, SignIn] = OrderedDict()

    def add(self, token: str | None) -> str:
        """A new sign-in for a checked token; its id, for the cookie."""
        while len(self._by_id) >= MAX_SIGN_INS:
            self._by_id.popitem(last=False)
        sign_in_id = new_secret()
        self._by_id[sign_in_id] = SignIn(token, new_secret(), time.monotonic())
        return sign_in_id

    def get(self, sign_in_id: str) -> SignIn | None:
        sign_in = self._by_id.get(sign_in_id)
        if sign_in is None:
            return None
        now = time.monotonic()
        if now - sign_in.used_at > IDLE_S:
            del self._by_id[sign_in_id]
            return None
        sign_in.used_at = now
        self._by_id.move_to_end(sign_in_id)
        return sign_in

    def remove(self, sign_in_id: str) -> None:
        self._by_id.pop(sign_in_id, None)


def visitor(request: Request) -> Visitor:
    """The signed-in visitor; the token is checked again on each request, as the API
    checks every request's (a websocket's too: `visitor_of`).

    Raises:
        SignInNeeded: no cookie, an unknown or expired one, or a token no longer valid.
    """
    return visitor_of(request)


def visitor_of(connection: HTTPConnection) -> Visitor:
    """The signed-in visitor of a request or a websocket. Raises SignInNeeded."""
    sign_ins: SignIns = connection.app.state.sign_ins
    sign_in_id = cookie(connection, COOKIE)
    sign_in = sign_ins.get(sign_in_id) if sign_in_id else None
    if sign_in is None or sign_in_id is None:
        raise SignInNeeded
    try:
        caller = caller_of_token(connection.app.state.api, sign_in.token)
    except Unauthorized:
        sign_ins.remove(sign_in_id)
        raise SignInNeeded from None
    connection.state.caller = caller  # where the API's checks look for it, as its own do
    return Visitor(caller, sign_in.csrf)


@dataclass(frozen=True)
class Change:
    """A state-changing request: its signed-in caller and its form."""

    visitor: Visitor
    form: dict[str, str]


async def change(request: Request) -> Change:
    """The dependency of every POST: the caller, and its form with the CSRF token checked.

    Raises:
        SignInNeeded: as `visitor`.
        CSRFRefused: neither the form nor the X-CSRF-Token header holds the token.
    """
    who = visitor(request)
    form = await form_of(request)
    check_csrf(request, form.get(CSRF_FIELD), who.csrf)
    return Change(who, form)


async def form_of(request: Request) -> dict[str, str]:
    """The fields of a urlencoded form (as browsers and htmx send them); {} for any other body."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        return {}
    body = (await request.body()).decode("utf-8", "replace")
    try:
        return dict(parse_qsl(body, keep_blank_values=True, max_num_fields=MAX_FORM_FIELDS))
    except ValueError:  # too many fields: no form of ours
        return {}


def check_csrf(request: HTTPConnection, given: str | None, expected: str) -> None:
    """Raises CSRFRefused unless the form field or the X-CSRF-Token header is expected."""
    for candidate in (given, request.headers.get(CSRF_HEADER)):
        if candidate and hmac.compare_digest(candidate.encode(), expected.encode()):
            return
    raise CSRFRefused


def _signer(request: HTTPConnection) -> Signer:
    signer: Signer = request.app.state.api.state.signer
    return signer


def cookie(request: HTTPConnection, name: str) -> str | None:
    """The value of one of the inspector's cookies, if the server signed it (and lately)."""
    signed = request.cookies.get(name)
    if not signed:
        return None
    try:
        value = _signer(request).verify(f"ui.{name}", signed).get("v")
    except BadSignature:
        return None
    return value if isinstance(value, str) else None


def set_cookie(request: Request, response: Response, name: str, value: str) -> None:
    """Set one of the inspector's cookies, signed: HttpOnly, SameSite=Strict, Path=/ui,
    Secure over https."""
    signed = _signer(request).sign(f"ui.{name}", {"v": value}, time.time() + IDLE_S)
    response.set_cookie(
        name,
        signed,
        path=PREFIX,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def forget_cookie(request: Request, response: Response, name: str) -> None:
    response.delete_cookie(
        name, path=PREFIX, httponly=True, samesite="strict", secure=request.url.scheme == "https"
    )


def may_see_cluster(manager: SessionManager, who: Visitor) -> bool:
    """Whether the visitor sees the cluster's nodes (and may drain them): an admin, as
    /v1/cluster decides (`require_admin`), on a cluster."""
    return who.caller.is_admin and manager.cluster_view() is not None
