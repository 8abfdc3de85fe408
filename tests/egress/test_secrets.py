"""The secrets file, its checks against the policies, and placeholders (no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloche.errors import EgressConfigError
from cloche.network.egress.policy import EgressConfig
from cloche.network.egress.secrets import PLACEHOLDER_PREFIX, Secrets, Substitution

POLICIES = EgressConfig.from_dict(
    {
        "policies": {
            "gh": {"allow": ["api.github.com:443", "*.example.com"], "secrets": ["TOKEN"]},
            "none": {"allow": ["api.github.com:443"]},
        }
    }
)


def secrets_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "secrets.toml"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_secret_is_read_checked_and_never_shown(tmp_path: Path) -> None:
    path = secrets_file(
        tmp_path, '[secrets.TOKEN]\nvalue = "s3cr3t"\nhosts = ["api.github.com:443"]\n'
    )
    loaded = Secrets.load(path)
    loaded.check(POLICIES.policies.values())
    assert "s3cr3t" not in repr(loaded.by_name["TOKEN"]) and "s3cr3t" not in repr(loaded)
    made = loaded.placeholders(POLICIES.policies["gh"], None)
    assert made["TOKEN"].startswith(PLACEHOLDER_PREFIX)
    assert loaded.placeholders(POLICIES.policies["gh"], made) == made  # kept
    assert loaded.placeholders(POLICIES.policies["gh"], None) != made  # unique per session
    assert loaded.placeholders(POLICIES.policies["none"], None) == {}
    swap = Substitution(loaded, made)
    token = made["TOKEN"].encode()
    head = b"GET /user?t=" + token + b" HTTP/1.1\r\nAuthorization: Bearer " + token + b"\r\n\r\n"
    out, replaced, leaked = swap.apply(head, "api.github.com", 443)
    assert out.count(b"s3cr3t") == 2 and token not in out and replaced == ["TOKEN"]
    out, replaced, leaked = swap.apply(head, "www.example.com", 443)
    assert out == head and replaced == [] and leaked == ["TOKEN"]
    assert swap.carries_secrets("api.github.com", 443)
    assert not swap.carries_secrets("api.github.com", 80)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[secrets.TOKEN]\nvalue = ""\nhosts = ["a.com"]\n', "non-empty string"),
        ('[secrets.TOKEN]\nvalue = "x"\nhosts = []\n', "non-empty list"),
        ('[secrets.TOKEN]\nvalue = "x"\n', "exactly value and hosts"),
        ('[secrets."not a name"]\nvalue = "x"\nhosts = ["a.com"]\n', "variable name"),
        ("[other]\nx = 1\n", "expected only"),
    ],
)
def test_bad_secrets_files_are_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(EgressConfigError, match=message):
        Secrets.load(secrets_file(tmp_path, text))


def test_a_secrets_file_others_may_read_is_refused(tmp_path: Path) -> None:
    path = secrets_file(tmp_path, "", mode=0o640)
    with pytest.raises(EgressConfigError, match="chmod 600"):
        Secrets.load(path)


def test_policies_may_only_name_secrets_that_exist_for_hosts_they_allow(tmp_path: Path) -> None:
    elsewhere = Secrets.load(
        secrets_file(tmp_path, '[secrets.TOKEN]\nvalue = "x"\nhosts = ["evil.net:443"]\n')
    )
    with pytest.raises(EgressConfigError, match="'evil.net:443', which policy 'gh' does not"):
        elsewhere.check(POLICIES.policies.values())
    with pytest.raises(EgressConfigError, match="names secret 'TOKEN', which --secrets"):
        Secrets({}).check(POLICIES.policies.values())
