"""Tenants: who may call the server, in which role, on what terms.

`--tokens FILE` (TOML, readable by its owner only), one table per tenant:

    [tokens.alice]
    token = "s3cret"                 # or token_sha256 = "<hex of its SHA-256>"
    role = "user"                    # or "admin"
    max_live_sessions = 20           # quotas (sessions/quotas.py); each may be left out
    max_paused_sessions = 200
    max_running_cells = 8
    max_snapshot_bytes = 10737418240
    max_volume_bytes = 53687091200   # the sizes of its volumes together
    egress = "research"              # the --egress-policy policy its sessions get by default
    webhook = "https://hooks.example.com/cloche"   # its sessions' events, signed with
    webhook_secret = "whsec_..."                    # this key (Standard Webhooks)

Tokens given with `--token` are users without quotas, those with `--admin-token` admins. A
token is kept only as its SHA-256 digest once loaded; an offered token is hashed and
compared with every tenant's digest (`hmac.compare_digest`, no early exit). The digest, as
hex, is also the tenant's owner key: the sessions a token makes are recorded under it,
whichever way the tenant was written.

Admins may view the cluster, drain and resume its nodes, and list every tenant's sessions
(`GET /v1/sessions?all=true`); a session is acted on by id only with its owner's token,
an admin's included.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
import urllib.parse
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cloche.errors import ConfigError, EgressConfigError
from cloche.network.egress.policy import check_private_file
from cloche.server.webhooks import secret_key
from cloche.sessions.quotas import Quotas, Terms

Role = Literal["user", "admin"]
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
FLAG_USERS = "token"  # the name of tenants given with --token
FLAG_ADMINS = "admin-token"  # and with --admin-token


def digest(token: str) -> bytes:
    """A token's SHA-256 digest (its hex is the owner key of the sessions it makes)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class Tenant:
    """One tenant: its name, role, token digest and terms."""

    name: str
    role: Role
    token_sha256: bytes = field(repr=False)
    terms: Terms
    webhook: str | None = None
    webhook_secret: str | None = field(default=None, repr=False)

    @property
    def owner_key(self) -> str:
        """What its sessions are recorded under (`sessions.session.owner_key`)."""
        return self.token_sha256.hex()

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def quotas(self) -> Quotas:
        return self.terms.quotas


@dataclass(frozen=True)
class Caller:
    """Who is asking: the token it gave (the owner of the sessions it makes, as the session
    manager is told) and its tenant. On a server without tokens both are None, and the
    caller may do everything (as before tenants)."""

    token: str | None = field(default=None, repr=False)
    tenant: Tenant | None = None

    @property
    def name(self) -> str | None:
        """The tenant's name; None on a server without tokens."""
        return self.tenant.name if self.tenant is not None else None

    @property
    def is_admin(self) -> bool:
        """An admin's token, or a server without tokens."""
        return self.tenant is None or self.tenant.is_admin

    @property
    def sees_all(self) -> bool:
        """Whether listings and events may show every tenant's sessions."""
        return self.is_admin

    @property
    def owner_key(self) -> str | None:
        return self.tenant.owner_key if self.tenant is not None else None

    @property
    def quotas(self) -> Quotas:
        return self.tenant.quotas if self.tenant is not None else Quotas()


OPEN = Caller()  # every caller of a server without tokens


class _Table(BaseModel):
    """One [tokens.NAME] table as written."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    token: str | None = Field(None, min_length=1)
    token_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    role: Role = "user"
    max_live_sessions: int | None = Field(None, ge=1)
    max_paused_sessions: int | None = Field(None, ge=0)
    max_running_cells: int | None = Field(None, ge=1)
    max_snapshot_bytes: int | None = Field(None, ge=0)
    max_volume_bytes: int | None = Field(None, ge=0)
    egress: str | None = Field(None, min_length=1)
    webhook: str | None = None
    webhook_secret: str | None = Field(None, repr=False)

    @field_validator("webhook")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urllib.parse.urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("must be an http:// or https:// URL")
        return value

    @field_validator("webhook_secret")
    @classmethod
    def _secret(cls, value: str | None) -> str | None:
        if value is not None:
            secret_key(value)  # raises ValueError, saying what is wrong
        return value

    @model_validator(mode="after")
    def _one_token(self) -> _Table:
        if (self.token is None) == (self.token_sha256 is None):
            raise ValueError("give either token or token_sha256 (one of them)")
        if (self.webhook is None) != (self.webhook_secret is None):
            raise ValueError("a webhook and its webhook_secret (whsec_<base64 key>) go together")
        return self

    def tenant(self, name: str) -> Tenant:
        if self.token is not None:
            hashed = digest(self.token)
        else:
            assert self.token_sha256 is not None
            hashed = bytes.fromhex(self.token_sha256)
        quotas = Quotas(
            max_live_sessions=self.max_live_sessions,
            max_paused_sessions=self.max_paused_sessions,
            max_running_cells=self.max_running_cells,
            max_snapshot_bytes=self.max_snapshot_bytes,
            max_volume_bytes=self.max_volume_bytes,
        )
        return Tenant(
            name=name,
            role=self.role,
            token_sha256=hashed,
            terms=Terms(name, quotas, self.egress),
            webhook=self.webhook,
            webhook_secret=self.webhook_secret,
        )


def _problems(exc: ValidationError) -> str:
    said = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            said.append(f"{where}: unknown key (known: {', '.join(_Table.model_fields)})")
        else:
            message = str(error["msg"]).removeprefix("Value error, ")
            said.append(f"{where}: {message}" if where else message)
    return "; ".join(said)


def read_tokens_file(path: Path) -> list[Tenant]:
    """The tenants of a --tokens file.

    Raises:
        ConfigError: unreadable, readable by others, not TOML, or a table that is wrong
            (naming the tenant and the key).
    """
    try:
        check_private_file(path)
        data: dict[str, Any] = tomllib.loads(path.read_text())
    except EgressConfigError as exc:
        raise ConfigError(f"--tokens {exc}") from exc
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--tokens {path}: {exc}") from exc
    tables = data.get("tokens", {})
    if set(data) - {"tokens"} or not isinstance(tables, dict):
        raise ConfigError(f"--tokens {path}: expected only [tokens.NAME] tables")
    tenants = []
    for name, table in tables.items():
        if not _NAME.match(name):
            raise ConfigError(
                f"--tokens {path}: tenant {name!r}: a name is letters, digits, '_', '.', '-'"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"--tokens {path}: tenant {name!r}: expected a table")
        try:
            tenants.append(_Table.model_validate(table).tenant(name))
        except ValidationError as exc:
            raise ConfigError(f"--tokens {path}: tenant {name!r}: {_problems(exc)}") from None
    return tenants


class Tenants:
    """The server's tenants, found by token (in constant time) or by owner key."""

    def __init__(self, tenants: Iterable[Tenant] = ()) -> None:
        """Raises ConfigError: two tenants with the same token."""
        self._tenants = tuple(tenants)
        self._by_key: dict[str, Tenant] = {}
        for tenant in self._tenants:
            other = self._by_key.setdefault(tenant.owner_key, tenant)
            if other is not tenant:
                raise ConfigError(
                    f"tenants {other.name!r} and {tenant.name!r} have the same token "
                    "(--tokens, --token, --admin-token): give each its own"
                )

    @classmethod
    def load(
        cls,
        tokens_file: Path | None = None,
        tokens: Iterable[str] = (),
        admin_tokens: Iterable[str] = (),
    ) -> Tenants:
        """The tenants of --tokens FILE, --token (users) and --admin-token (admins).

        Raises:
            ConfigError: a bad file, or a token given twice.
        """
        found = read_tokens_file(tokens_file) if tokens_file is not None else []
        given: tuple[tuple[Role, str, Iterable[str]], ...] = (
            ("user", FLAG_USERS, tokens),
            ("admin", FLAG_ADMINS, admin_tokens),
        )
        for role, name, plain in given:
            found.extend(Tenant(name, role, digest(token), Terms(name)) for token in set(plain))
        return cls(found)

    @property
    def required(self) -> bool:
        """Whether callers need a token (the server has any)."""
        return bool(self._tenants)

    @property
    def gated(self) -> bool:
        """Whether any tenant has quotas or a default egress policy."""
        return any(tenant.terms.gated for tenant in self._tenants)

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self._tenants)

    def __len__(self) -> int:
        return len(self._tenants)

    def find(self, token: str) -> Tenant | None:
        """The tenant of a token: its digest compared with every tenant's in constant
        time, without stopping at the first equal one."""
        offered = digest(token)
        found = None
        for tenant in self._tenants:
            if hmac.compare_digest(tenant.token_sha256, offered):
                found = tenant
        return found

    def caller(self, token: str | None) -> Caller | None:
        """The caller a token makes; None for no token or a wrong one (on a server with
        tokens; on one without, every caller is `OPEN`)."""
        if not self._tenants:
            return OPEN
        tenant = self.find(token) if token else None
        return Caller(token, tenant) if tenant is not None else None

    def by_owner_key(self, key: str | None) -> Tenant | None:
        """The tenant whose sessions are recorded under key (an event's `owner_key`)."""
        return self._by_key.get(key) if key is not None else None

    def terms_of(self, key: str) -> Terms | None:
        """The terms of the owner whose key that is (for `QuotaGate`)."""
        tenant = self._by_key.get(key)
        return tenant.terms if tenant is not None else None

    def check_egress(self, policies: Collection[str] | None) -> None:
        """Every tenant's egress names one of the server's policies.

        Raises:
            ConfigError: naming the tenant and the policy.
        """
        for tenant in self._tenants:
            wanted = tenant.terms.egress
            if wanted is None:
                continue
            if policies is None:
                raise ConfigError(
                    f"tenant {tenant.name!r} has egress = {wanted!r}, but the server has no "
                    "--egress-policy file"
                )
            if wanted not in policies:
                known = ", ".join(sorted(policies)) or "none"
                raise ConfigError(
                    f"tenant {tenant.name!r} has egress = {wanted!r}, which --egress-policy "
                    f"does not define (it has: {known})"
                )
