"""Egress policies: rules, deny first, names and addresses apart, narrowing (no server)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from cloche.errors import EgressConfigError, EgressRefused
from cloche.network.egress.policy import EgressConfig, Rule, check_private_file

FILE = """
[policies.default]
allow = []

[policies.research]
allow = ["api.github.com:443", "*.pypi.org", "data.example.com:80,443", "10.0.0.7:5432",
         "192.168.0.0/16:8080", "[::1]:9000"]
deny = ["*.internal", "evil.pypi.org"]
secrets = ["GITHUB_TOKEN"]
max_connections = 16
max_bytes = 1073741824
requests_per_minute = 600
"""


@pytest.fixture
def config(tmp_path: Path) -> EgressConfig:
    path = tmp_path / "egress.toml"
    path.write_text(FILE)
    return EgressConfig.load(path)


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def test_rules_read_as_the_spec_writes_them(config: EgressConfig) -> None:
    research = config.policies["research"]
    assert research.decide("api.github.com", 443).allowed
    assert not research.decide("api.github.com", 80).allowed  # its port only
    assert research.decide("files.pypi.org", 80).allowed  # no port: 80 and 443
    assert research.decide("Files.PyPI.org.", 443).allowed  # case and a trailing dot
    assert not research.decide("pypi.org", 443).allowed  # *. is subdomains only
    assert not research.decide("files.pypi.org", 8080).allowed
    assert research.decide("data.example.com", 80).allowed
    assert research.max_connections == 16 and research.secrets == ("GITHUB_TOKEN",)


def test_deny_rules_come_first(config: EgressConfig) -> None:
    decision = config.policies["research"].decide("evil.pypi.org", 443)
    assert not decision.allowed and decision.rule == "deny evil.pypi.org"
    assert decision.reason == "denied"
    assert config.policies["research"].decide("db.internal", 443).rule == "deny *.internal"


def test_names_and_addresses_are_matched_apart(config: EgressConfig) -> None:
    research = config.policies["research"]
    assert research.decide(ip("10.0.0.7"), 5432).allowed
    assert research.decide(ip("192.168.4.2"), 8080).allowed
    assert research.decide(ip("::1"), 9000).allowed
    assert not research.decide("10.0.0.7", 5432).allowed  # a name is not an address
    assert not research.decide(ip("10.0.0.8"), 5432).allowed
    refused = research.decide(ip("140.82.112.5"), 443)  # api.github.com's, as an address
    assert not refused.allowed and "address" in refused.rule


def test_narrowing_keeps_inside_the_policy(config: EgressConfig) -> None:
    narrowed = config.resolve({"policy": "research", "allow": ["api.github.com:443"]})
    assert narrowed is not None
    assert narrowed.decide("api.github.com", 443).allowed
    assert not narrowed.decide("files.pypi.org", 443).allowed
    assert narrowed.deny == config.policies["research"].deny
    assert narrowed.describe() == {"policy": "research", "allow": ["api.github.com:443"]}
    assert config.resolve({"policy": "research", "allow": ["x.y.pypi.org:443", "*.a.pypi.org"]})
    assert config.resolve({"policy": "research", "allow": ["10.0.0.7:5432", "192.168.1.0/24:8080"]})
    for wider in ("api.github.com:80", "*.github.com:443", "example.com", "10.0.0.0/8:5432",
                  "pypi.org:443", "192.168.0.0/15:8080"):  # fmt: skip
        with pytest.raises(EgressRefused, match="wider than policy 'research'"):
            config.resolve({"policy": "research", "allow": [wider]})


def test_asking_for_nothing_gets_the_default_and_unknown_names_are_refused(
    config: EgressConfig,
) -> None:
    assert config.resolve(None) is config.policies["default"]
    assert config.resolve("research") is config.policies["research"]
    with pytest.raises(EgressRefused, match="unknown egress policy 'nope'"):
        config.resolve("nope")
    with pytest.raises(EgressRefused, match="unknown keys"):
        config.resolve({"policy": "research", "deny": []})
    assert EgressConfig.from_dict({"policies": {}}).resolve(None) is None  # no default


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "non-empty"),
        ("api.github.com:https", "ports must be numbers"),
        ("api.github.com:0", "between 1 and 65535"),
        ("a*.example.com", "not a host name"),
        ("exa mple.com", "not a host name"),
        ("[::1]x", "':PORTS'"),
    ],
)
def test_bad_rules_are_named(text: str, message: str) -> None:
    with pytest.raises(EgressConfigError, match=message):
        Rule.parse(text)


def test_bad_files_are_named(tmp_path: Path) -> None:
    path = tmp_path / "egress.toml"
    for text, message in (
        ("[policies.a]\nallow = 'x'", "must be a list"),
        ("[policies.a]\nmax_bytes = -1", "positive integer"),
        ("[policies.a]\nallows = []", "unknown keys"),
        ("[policies.a\n", "egress policy"),
        ("upstream_ca_file = 'missing.pem'", "is not a file"),
    ):
        path.write_text(text)
        with pytest.raises(EgressConfigError, match=message):
            EgressConfig.load(path)


def test_a_secrets_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secrets.toml"
    path.write_text("")
    path.chmod(0o644)
    with pytest.raises(EgressConfigError, match="chmod 600"):
        check_private_file(path)
    path.chmod(0o600)
    check_private_file(path)
