"""Secrets that stay on the host: a session holds placeholders, the proxy puts the values in.

`--secrets FILE` (TOML, readable by its owner only):

    [secrets.GITHUB_TOKEN]
    value = "ghp_..."
    hosts = ["api.github.com"]          # policy patterns; no port means 80 and 443

A policy lists the secrets its sessions get (`secrets = ["GITHUB_TOKEN"]`), and each secret's
hosts must be allowed by that policy. A session's environment holds a placeholder per secret
(`GITHUB_TOKEN=cloche-secret-<random>`), unique to the session; requests to the secret's hosts
have the placeholder replaced by the value in their request line and headers, on the host.
The value is never logged, counted, recorded or saved: records name the secret only.
"""

from __future__ import annotations

import secrets as random_tokens
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cloche.errors import EgressConfigError
from cloche.network.egress.guard import literal
from cloche.network.egress.policy import Address, Policy, Rule, check_private_file

PLACEHOLDER_PREFIX = "cloche-secret-"


@dataclass(frozen=True)
class Secret:
    """One secret: its value and the hosts it may be sent to."""

    name: str
    value: str
    hosts: tuple[Rule, ...]

    def for_host(self, host: str, port: int) -> bool:
        """Whether host (a name, or an address as text) is one of the secret's, on port."""
        address = literal(host)
        target: str | Address = address if address is not None else host
        return any(rule.matches(target, port) for rule in self.hosts)

    def __repr__(self) -> str:  # never the value
        return f"Secret({self.name!r}, hosts={[r.text for r in self.hosts]})"


@dataclass(frozen=True)
class Secrets:
    """The server's secrets (from --secrets)."""

    by_name: Mapping[str, Secret]

    @classmethod
    def load(cls, path: Path) -> Secrets:
        """Raises EgressConfigError: unreadable, readable by others, or malformed."""
        try:
            check_private_file(path)
            data = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise EgressConfigError(f"--secrets {path}: {exc}") from exc
        unknown = set(data) - {"secrets"}
        tables = data.get("secrets", {})
        if unknown or not isinstance(tables, dict):
            raise EgressConfigError(f"--secrets {path}: expected only [secrets.NAME] tables")
        found = {}
        for name, table in tables.items():
            if not name.isidentifier():
                raise EgressConfigError(f"secret {name!r}: a name must be a variable name")
            if not isinstance(table, dict) or set(table) != {"value", "hosts"}:
                raise EgressConfigError(f"secret {name!r}: wants exactly value and hosts")
            value, hosts = table["value"], table["hosts"]
            if not isinstance(value, str) or not value:
                raise EgressConfigError(f"secret {name!r}: value must be a non-empty string")
            if not isinstance(hosts, list) or not hosts:
                raise EgressConfigError(f"secret {name!r}: hosts must be a non-empty list")
            found[name] = Secret(name, value, tuple(Rule.parse(host) for host in hosts))
        return cls(found)

    def check(self, policies: Iterable[Policy]) -> None:
        """Every secret a policy names exists, and its hosts are allowed by that policy.

        Raises:
            EgressConfigError: naming the policy and the secret.
        """
        for policy in policies:
            for name in policy.secrets:
                secret = self.by_name.get(name)
                if secret is None:
                    raise EgressConfigError(
                        f"egress policy {policy.name!r} names secret {name!r}, which --secrets "
                        "does not hold"
                    )
                for rule in secret.hosts:
                    if not any(allowed.covers(rule) for allowed in policy.allow):
                        raise EgressConfigError(
                            f"secret {name!r} goes to {rule.text!r}, which policy "
                            f"{policy.name!r} does not allow"
                        )

    def placeholders(self, policy: Policy, kept: Mapping[str, str] | None = None) -> dict[str, str]:
        """A session's placeholders (name -> placeholder): those it had, else new ones."""
        kept = kept or {}
        made = {}
        for name in policy.secrets:
            if name in self.by_name:
                made[name] = kept.get(name) or PLACEHOLDER_PREFIX + random_tokens.token_hex(16)
        return made


class Substitution:
    """One session's placeholders and the secrets they stand for."""

    def __init__(self, secrets: Secrets, placeholders: Mapping[str, str]) -> None:
        self.pairs = [
            (placeholder, secrets.by_name[name])
            for name, placeholder in placeholders.items()
            if name in secrets.by_name
        ]

    def carries_secrets(self, host: str, port: int) -> bool:
        return any(secret.for_host(host, port) for _, secret in self.pairs)

    def apply(self, head: bytes, host: str, port: int) -> tuple[bytes, list[str], list[str]]:
        """The head with the placeholders of host's secrets replaced; the names replaced,
        and the names of placeholders seen that do not belong to host (attempted leaks)."""
        replaced, leaked = [], []
        for placeholder, secret in self.pairs:
            token = placeholder.encode()
            if token not in head:
                continue
            if secret.for_host(host, port):
                head = head.replace(token, secret.value.encode())
                replaced.append(secret.name)
            else:
                leaked.append(secret.name)
        return head, replaced, leaked
