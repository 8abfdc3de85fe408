"""Egress policies: which hosts and ports a session may reach, read from the server's TOML.

A rule is a host pattern with ports: `api.github.com:443`, `*.pypi.org` (80 and 443: a rule
without ports means both), `data.example.com:80,443`, an address `10.0.0.7:5432`, a network
`10.0.0.0/8:5432` or `[::1]:8080`. `*.example.com` matches its subdomains, not itself. A name
is matched by name rules only, an address (an IP literal asked for, or where a name resolved)
by address rules only. Deny rules are read first.

The file holds named policies (`[policies.NAME]`); `default` is what a session that asks for
nothing gets (absent: no egress). A session may narrow a named policy to fewer hosts; a rule
the policy does not cover is refused by name (`EgressRefused`).
"""

from __future__ import annotations

import ipaddress
import os
import stat
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cloche.errors import EgressConfigError, EgressRefused

DEFAULT_PORTS = frozenset({80, 443})
DEFAULT_POLICY = "default"
_POLICY_KEYS = frozenset(
    {"allow", "deny", "secrets", "max_connections", "max_bytes", "requests_per_minute"}
)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Rule:
    """One host pattern with its ports, as written."""

    text: str
    ports: frozenset[int]
    name: str | None = None  # lowercased; "*.example.com" for subdomains
    network: Network | None = None  # an address is a network of one

    @classmethod
    def parse(cls, text: str) -> Rule:
        if not isinstance(text, str) or not text.strip():
            raise EgressConfigError(f"an egress rule must be a non-empty string, not {text!r}")
        spec = text.strip().lower()
        host, ports = _split_ports(spec, text)
        try:
            return cls(text, ports, network=ipaddress.ip_network(host, strict=False))
        except ValueError:
            pass
        label = host.removeprefix("*.")
        if (
            not label
            or "*" in label
            or "/" in label
            or not all(
                part and all(c.isalnum() or c in "-_" for c in part) for part in label.split(".")
            )
        ):
            raise EgressConfigError(f"egress rule {text!r}: {host!r} is not a host name or address")
        return cls(text, ports, name=host)

    def matches(self, host: str | Address, port: int) -> bool:
        """Whether a name (a str) or an address is this rule's, on this port."""
        if port not in self.ports:
            return False
        if isinstance(host, str):
            return self.name is not None and _name_matches(self.name, host.lower().rstrip("."))
        return self.network is not None and host in self.network

    def covers(self, other: Rule) -> bool:
        """Whether everything `other` allows, this allows too."""
        if not other.ports <= self.ports:
            return False
        if other.network is not None:
            return self.network is not None and _subnet(other.network, self.network)
        assert other.name is not None
        if self.name is None:
            return False
        if other.name.startswith("*."):
            return self.name.startswith("*.") and (
                other.name == self.name or other.name.endswith(self.name[1:])
            )
        return _name_matches(self.name, other.name)


@dataclass(frozen=True)
class Decision:
    """What a policy says of one destination."""

    allowed: bool
    rule: str  # the rule that decided, or why none did
    reason: str  # allowed, denied, not-allowed, address


@dataclass(frozen=True)
class Policy:
    """One named policy, or a session's narrowing of it."""

    name: str
    allow: tuple[Rule, ...] = ()
    deny: tuple[Rule, ...] = ()
    secrets: tuple[str, ...] = ()
    max_connections: int | None = None
    max_bytes: int | None = None
    requests_per_minute: int | None = None
    narrowed: tuple[str, ...] | None = field(default=None, compare=False)

    def decide(self, host: str | Address, port: int) -> Decision:
        """Deny rules first, then allow rules; nothing matched is refused."""
        for rule in self.deny:
            if rule.matches(host, port):
                return Decision(False, f"deny {rule.text}", "denied")
        for rule in self.allow:
            if rule.matches(host, port):
                return Decision(True, f"allow {rule.text}", "allowed")
        kind = "name" if isinstance(host, str) else "address"
        return Decision(
            False, f"no allow rule of policy {self.name!r} names this {kind}", "not-allowed"
        )

    def names_address(self, address: Address, port: int) -> bool:
        """Whether an allow rule names this address (or its network) explicitly."""
        return self.decide(address, port).allowed

    def narrow(self, allow: Iterable[str]) -> Policy:
        """This policy with only `allow` allowed (each covered by one of its rules).

        Raises:
            EgressRefused: a rule wider than the policy, named.
        """
        asked = tuple(Rule.parse(text) for text in allow)
        for rule in asked:
            if not any(mine.covers(rule) for mine in self.allow):
                raise EgressRefused(
                    f"egress rule {rule.text!r} is wider than policy {self.name!r} allows "
                    f"(its rules: {', '.join(r.text for r in self.allow) or 'none'})"
                )
        return replace(self, allow=asked, narrowed=tuple(r.text for r in asked))

    def describe(self) -> dict[str, Any]:
        """The policy as the API shows it (and as a session keeps it across pauses)."""
        described: dict[str, Any] = {"policy": self.name}
        if self.narrowed is not None:
            described["allow"] = list(self.narrowed)
        return described


@dataclass(frozen=True)
class EgressConfig:
    """The server's ceiling: its named policies (from --egress-policy)."""

    policies: Mapping[str, Policy]
    upstream_ca_file: Path | None = None

    @classmethod
    def load(cls, path: Path) -> EgressConfig:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise EgressConfigError(f"egress policy {path}: {exc}") from exc
        return cls.from_dict(data, path.parent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base: Path | None = None) -> EgressConfig:
        unknown = set(data) - {"policies", "upstream_ca_file"}
        if unknown:
            raise EgressConfigError(f"egress policy: unknown keys {sorted(unknown)}")
        tables = data.get("policies", {})
        if not isinstance(tables, dict):
            raise EgressConfigError("egress policy: [policies.NAME] tables expected")
        policies = {name: _policy(name, table) for name, table in tables.items()}
        ca = data.get("upstream_ca_file")
        ca_path = None
        if ca is not None:
            ca_path = Path(ca) if base is None else base / ca
            if not ca_path.is_file():
                raise EgressConfigError(f"egress policy: upstream_ca_file {ca_path} is not a file")
        return cls(policies, ca_path)

    def resolve(self, asked: str | Mapping[str, Any] | None) -> Policy | None:
        """The policy a session gets for what it asked (None: no egress).

        Raises:
            EgressRefused: an unknown policy, or a rule wider than the named policy.
        """
        if asked is None:
            return self.policies.get(DEFAULT_POLICY)
        if isinstance(asked, str):
            return self._named(asked)
        if not isinstance(asked, Mapping):
            raise EgressRefused("egress must be a policy name or {policy, allow}")
        unknown = set(asked) - {"policy", "allow"}
        if unknown:
            raise EgressRefused(f"egress: unknown keys {sorted(unknown)} (policy, allow)")
        policy = self._named(asked.get("policy", DEFAULT_POLICY))
        allow = asked.get("allow")
        if allow is None:
            return policy
        if not isinstance(allow, list) or not all(isinstance(rule, str) for rule in allow):
            raise EgressRefused("egress.allow must be a list of rules such as 'host:443'")
        try:
            return policy.narrow(allow)
        except EgressConfigError as exc:
            raise EgressRefused(str(exc)) from exc

    def _named(self, name: object) -> Policy:
        if not isinstance(name, str) or name not in self.policies:
            known = ", ".join(sorted(self.policies)) or "none: the server has no egress policy"
            raise EgressRefused(f"unknown egress policy {name!r} (known: {known})")
        return self.policies[name]


def check_private_file(path: Path) -> None:
    """Refuse a secrets file that others may read or write.

    Raises:
        EgressConfigError: it is readable or writable by group or others.
    """
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise EgressConfigError(
            f"{path} may be read by others (mode {stat.filemode(mode)}): chmod 600"
        )


def _policy(name: str, table: object) -> Policy:
    if not isinstance(table, dict):
        raise EgressConfigError(f"egress policy {name!r}: a table expected")
    unknown = set(table) - _POLICY_KEYS
    if unknown:
        raise EgressConfigError(f"egress policy {name!r}: unknown keys {sorted(unknown)}")

    def rules(key: str) -> tuple[Rule, ...]:
        values = table.get(key, [])
        if not isinstance(values, list):
            raise EgressConfigError(f"egress policy {name!r}: {key} must be a list")
        return tuple(Rule.parse(value) for value in values)

    def limit(key: str) -> int | None:
        value = table.get(key)
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise EgressConfigError(f"egress policy {name!r}: {key} must be a positive integer")
        return value

    secrets = table.get("secrets", [])
    if not isinstance(secrets, list) or not all(isinstance(s, str) for s in secrets):
        raise EgressConfigError(f"egress policy {name!r}: secrets must be a list of names")
    return Policy(
        name=name,
        allow=rules("allow"),
        deny=rules("deny"),
        secrets=tuple(secrets),
        max_connections=limit("max_connections"),
        max_bytes=limit("max_bytes"),
        requests_per_minute=limit("requests_per_minute"),
    )


def _split_ports(spec: str, text: str) -> tuple[str, frozenset[int]]:
    """`host:p1,p2` → (host, ports); `[v6]:p`, a bare v6 address and no port handled."""
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        port_text = rest.removeprefix(":") if rest.startswith(":") else None
        if rest and port_text is None:
            raise EgressConfigError(f"egress rule {text!r}: text after ']' must be ':PORTS'")
    elif spec.count(":") == 1:
        host, _, port_text = spec.partition(":")
    else:
        host, port_text = spec, None  # a name, or an IPv6 address without brackets
    if port_text is None:
        return host, DEFAULT_PORTS
    try:
        ports = frozenset(int(p) for p in port_text.split(","))
    except ValueError:
        raise EgressConfigError(
            f"egress rule {text!r}: ports must be numbers such as 443 or 80,443"
        ) from None
    if not ports or not all(0 < p < 65536 for p in ports):
        raise EgressConfigError(f"egress rule {text!r}: ports must be between 1 and 65535")
    return host, ports


def _name_matches(pattern: str, name: str) -> bool:
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and len(name) > len(pattern) - 1
    return name == pattern


def _subnet(inner: Network, outer: Network) -> bool:
    return inner.version == outer.version and inner.subnet_of(outer)  # type: ignore[arg-type]
