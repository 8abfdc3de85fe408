"""Preview tokens: a signed, expiring permission to reach one port of one session, which a
browser may hold without the API's token, and the host names ports are served at.

A token is signed by the server's `Signer` (the inspector's cookies are too) for the purpose
`preview`, and names the session, the port and the owner's key; it opens that port of that
session until it expires, and nothing else: it is never a bearer token anywhere. Given as
`?cloche_preview=T`, it sets a cookie of the same value that expires with it, scoped to the
port's host (host routes) or the port's path (path routes), so the app's own links work.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from http.cookies import SimpleCookie
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from cloche.errors import ConfigError, SessionNotFound, Unauthorized
from cloche.server.signing import BadSignature, Expired, Signer
from cloche.sessions.ports import OwnerKey

PURPOSE = "preview"
PARAMETER = "cloche_preview"  # in a preview URL's query
COOKIE = "cloche_preview"
MIN_TTL_S = 1
MAX_TTL_S = 86400
# `{port}-{session id}` as the first label of a preview host
_LABEL = re.compile(
    r"^([1-9][0-9]{0,4})-([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$"
)
_DOMAIN = re.compile(r"^(?:(https?)://)?([a-z0-9](?:[a-z0-9.-]*[a-z0-9])?)(?::([0-9]{1,5}))?/?$")


@dataclass(frozen=True)
class PreviewDomain:
    """--preview-domain: ports are served at `{port}-{id}.{host}`, on the server's HTTP port
    (behind a proxy, the scheme and port the URLs name)."""

    host: str
    scheme: str = "http"
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> PreviewDomain:
        """`preview.example.com`, with a scheme (`https://...`) or a port (`...:8443`).

        Raises:
            ConfigError: it is not a host name.
        """
        match = _DOMAIN.match(text.strip().lower())
        if match is None or ".." in match[2]:
            raise ConfigError(
                f"--preview-domain {text!r} is not a host name (say preview.example.com, "
                "https://preview.example.com or localhost:8080)"
            )
        port = int(match[3]) if match[3] else None
        if port is not None and not 0 < port < 65536:
            raise ConfigError(f"--preview-domain {text!r}: no such port")
        return cls(match[2], match[1] or "http", port)

    def match(self, host: str) -> tuple[int, str] | None | bool:
        """(port, session id) for a Host header naming a preview host; True for a host
        under the domain that names none (never the API's); None for any other host, the
        domain itself included (it may be the API's own)."""
        name = host.strip().lower().rpartition(":")[0] if ":" in host else host.strip().lower()
        if name.endswith("."):
            name = name[:-1]
        if not name.endswith("." + self.host):
            return None
        found = _LABEL.match(name[: -len(self.host) - 1])
        if found is None or int(found[1]) > 65535:
            return True
        return int(found[1]), found[2]

    def url(self, port: int, session_id: str) -> str:
        """The root of a port's host."""
        tail = f":{self.port}" if self.port is not None else ""
        return f"{self.scheme}://{port}-{session_id}.{self.host}{tail}/"


def mint(
    signer: Signer, session_id: str, port: int, owner_key: str | None, ttl_s: int
) -> tuple[str, float]:
    """A preview token and when it expires (unix time, s)."""
    expires_at = float(int(time.time() + ttl_s))
    token = signer.sign(PURPOSE, {"s": session_id, "p": port, "o": owner_key}, expires_at)
    return token, expires_at


def owner_of(signer: Signer, token: str, session_id: str, port: int) -> tuple[OwnerKey, float]:
    """The owner a preview token speaks for, and when it expires.

    Raises:
        Unauthorized: not a token of this server's, or expired.
        SessionNotFound: a good token, for another session or port.
    """
    try:
        fields = signer.verify(PURPOSE, token)
    except Expired:
        raise Unauthorized("this preview token has expired: ask for a new preview URL") from None
    except BadSignature:
        raise Unauthorized("not a preview token of this server's") from None
    if fields.get("s") != session_id or fields.get("p") != port:
        raise SessionNotFound(session_id)
    owner = fields.get("o")
    return OwnerKey(owner if isinstance(owner, str) else None), float(fields["exp"])


def with_token(url: str, token: str) -> str:
    """url with the token as its query's `cloche_preview`."""
    parts = urlsplit(url)
    query = urlencode([*parse_qsl(parts.query, keep_blank_values=True), (PARAMETER, token)])
    return urlunsplit(parts._replace(query=query))


def cookie_tokens(header: str) -> list[str]:
    """Every `cloche_preview` in a Cookie header (a page of another port may have set one
    on a parent domain: each is tried)."""
    found = []
    for pair in header.split(";"):
        name, eq, value = pair.strip().partition("=")
        if eq and name == COOKIE and value:
            found.append(value.strip('"'))
    return found


def without_preview_cookies(header: str) -> str:
    """A Cookie header without cloche's preview cookies (the app never sees a credential)."""
    kept = [p.strip() for p in header.split(";") if p.strip().partition("=")[0] != COOKIE]
    return "; ".join(p for p in kept if p)


def set_cookie(token: str, expires_at: float, path: str, secure: bool) -> str:
    """The Set-Cookie value that keeps a preview token in the browser until it expires."""
    cookie: SimpleCookie = SimpleCookie()
    cookie[COOKIE] = token
    morsel = cookie[COOKIE]
    morsel["path"] = path
    morsel["max-age"] = str(max(0, int(expires_at - time.time())))
    morsel["httponly"] = True
    morsel["samesite"] = "Lax"
    if secure:
        morsel["secure"] = True
    return morsel.OutputString()
