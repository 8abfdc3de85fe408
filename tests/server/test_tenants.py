"""`--tokens FILE`: tenants read, checked and kept hashed; a token finds its tenant."""

from __future__ import annotations

import gc
import hashlib
import types
from pathlib import Path

import pytest

from cloche.cli import build_parser
from cloche.commands.serve import config_from_args
from cloche.errors import ConfigError
from cloche.server.tenants import FLAG_ADMINS, FLAG_USERS, Tenants, read_tokens_file
from cloche.sessions.quotas import Quotas

GOOD = """
[tokens.alice]
token = "alice-s3cret"
role = "user"
max_live_sessions = 20
max_paused_sessions = 200
max_running_cells = 8
max_snapshot_bytes = 10737418240
egress = "research"
webhook = "https://hooks.example.com/cloche"
webhook_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

[tokens.ops]
token_sha256 = "{ops_sha}"
role = "admin"
"""
OPS_TOKEN = "ops-token-never-written"


def write(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    path.chmod(mode)
    return path


def good_file(tmp_path: Path) -> Path:
    return write(tmp_path, GOOD.format(ops_sha=hashlib.sha256(OPS_TOKEN.encode()).hexdigest()))


def test_a_good_file_gives_each_tenant_its_role_quotas_egress_and_webhook(tmp_path):
    alice, ops = read_tokens_file(good_file(tmp_path))
    assert (alice.name, alice.role, ops.name, ops.role) == ("alice", "user", "ops", "admin")
    assert alice.quotas == Quotas(20, 200, 8, 10737418240)
    assert alice.terms.egress == "research" and alice.terms.tenant == "alice"
    assert alice.webhook == "https://hooks.example.com/cloche"
    assert alice.webhook_secret == "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    assert ops.quotas == Quotas() and not ops.terms.gated and alice.terms.gated
    assert ops.owner_key == hashlib.sha256(OPS_TOKEN.encode()).hexdigest()


def test_a_token_finds_its_own_tenant_and_no_other(tmp_path):
    tenants = Tenants.load(good_file(tmp_path), tokens=["plain"], admin_tokens=["boss"])
    assert tenants.find("alice-s3cret").name == "alice"
    assert tenants.find(OPS_TOKEN).name == "ops"  # written only as its hash
    assert tenants.find("plain").name == FLAG_USERS and tenants.find("plain").role == "user"
    assert tenants.find("boss").name == FLAG_ADMINS and tenants.find("boss").is_admin
    for wrong in ("", "alice-s3cre", "alice-s3cret ", "ALICE-S3CRET", "\ud800", "x" * 10_000):
        assert tenants.find(wrong) is None
        assert tenants.caller(wrong) is None
    caller = tenants.caller("alice-s3cret")
    assert caller.token == "alice-s3cret" and caller.name == "alice" and not caller.is_admin
    assert caller.owner_key == hashlib.sha256(b"alice-s3cret").hexdigest()
    assert tenants.caller(OPS_TOKEN).sees_all
    assert tenants.by_owner_key(caller.owner_key).name == "alice"
    assert tenants.terms_of(caller.owner_key).quotas.max_live_sessions == 20


def test_the_lookup_compares_with_every_tenant_and_stops_at_none(tmp_path, monkeypatch):
    import cloche.server.tenants as module

    tenants = Tenants.load(good_file(tmp_path), tokens=["a", "b", "c"])
    compared: list[bytes] = []
    real = module.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(a)
        return real(a, b)

    monkeypatch.setattr(module.hmac, "compare_digest", counting)
    for token in ("alice-s3cret", "c", "nobody"):  # first, last, none
        compared.clear()
        tenants.find(token)
        assert len(compared) == len(tenants) == 5


def test_tokens_are_kept_only_as_hashes(tmp_path):
    tenants = Tenants.load(good_file(tmp_path), tokens=["plain-token-xyz"])
    # Everything the tenants hold (their objects, not their classes or modules' code).
    seen: list[object] = []
    stack: list[object] = [tenants]
    while stack:
        item = stack.pop()
        if any(item is s for s in seen):
            continue
        seen.append(item)
        if isinstance(item, str | bytes | type | types.ModuleType | types.FunctionType):
            continue
        stack.extend(gc.get_referents(item))
    assert len(seen) > 20
    texts = [s for s in seen if isinstance(s, str)]
    assert not any("alice-s3cret" in t or "plain-token-xyz" in t for t in texts)
    assert "alice-s3cret" not in repr(list(tenants))


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ('token = "t"\nrole = "root"', "tenant 'bob': role: Input should be 'user' or 'admin'"),
        ('token = "t"\nrol = "user"', "tenant 'bob': rol: unknown key"),
        (
            'token = "t"\ntoken_sha256 = "' + "a" * 64 + '"',
            "tenant 'bob': give either token or token_sha256",
        ),
        ('role = "user"', "tenant 'bob': give either token or token_sha256"),
        ('token_sha256 = "abc"', "tenant 'bob': token_sha256: String should match"),
        ('token = "t"\nmax_live_sessions = 0', "max_live_sessions: Input should be greater"),
        ('token = "t"\nmax_running_cells = "8"', "max_running_cells: Input should be a valid"),
        ('token = "t"\nmax_live_sessions = true', "max_live_sessions: Input should be a valid"),
        ('token = "t"\nwebhook = "ftp://x"', "webhook: must be an http:// or https:// URL"),
        (
            'token = "t"\nwebhook = "https://x"\nwebhook_secret = "s3"',
            "webhook_secret: a webhook secret starts with 'whsec_'",
        ),
        ('token = "t"\nwebhook_secret = "whsec_AAAA"', "a webhook and its webhook_secret"),
        ('token = "t"\nwebhook = "https://x"', "a webhook and its webhook_secret"),
    ],
)
def test_a_bad_table_is_refused_naming_the_tenant_and_the_key(tmp_path, table, said):
    with pytest.raises(ConfigError) as refused:
        read_tokens_file(write(tmp_path, f"[tokens.bob]\n{table}\n"))
    assert said in str(refused.value)
    assert "--tokens" in str(refused.value)


def test_a_file_others_may_read_is_refused(tmp_path):
    path = good_file(tmp_path)
    for mode in (0o644, 0o640, 0o604, 0o660):
        path.chmod(mode)
        with pytest.raises(ConfigError, match=r"--tokens .* may be read by others .*chmod 600"):
            read_tokens_file(path)


def test_other_shapes_of_file_are_refused(tmp_path):
    for text, said in (
        ("[users.bob]\ntoken = 't'\n", "expected only [tokens.NAME] tables"),
        ("tokens = 3\n", "expected only [tokens.NAME] tables"),
        ("[tokens]\nbob = 3\n", "tenant 'bob': expected a table"),
        ('[tokens."bad name"]\ntoken = "t"\n', "a name is letters"),
        ("[tokens.bob\n", "--tokens"),
    ):
        with pytest.raises(ConfigError, match=None) as refused:
            read_tokens_file(write(tmp_path, text))
        assert said in str(refused.value)
    with pytest.raises(ConfigError, match="--tokens"):
        read_tokens_file(tmp_path / "missing.toml")


def test_the_same_token_twice_is_refused(tmp_path):
    path = good_file(tmp_path)
    with pytest.raises(ConfigError, match="'alice' and 'token' have the same token"):
        Tenants.load(path, tokens=["alice-s3cret"])
    with pytest.raises(ConfigError, match="same token"):
        Tenants.load(None, tokens=["x"], admin_tokens=["x"])


def test_a_server_without_tokens_lets_everyone_in_as_admin():
    tenants = Tenants.load()
    assert not tenants.required and not tenants.gated
    caller = tenants.caller(None)
    assert caller is not None and caller.token is None and caller.is_admin


def test_a_tenant_s_egress_must_be_one_of_the_server_s_policies(tmp_path):
    tenants = Tenants.load(good_file(tmp_path))
    tenants.check_egress({"research", "default"})
    with pytest.raises(ConfigError, match="tenant 'alice' has egress = 'research'.*no --egress"):
        tenants.check_egress(None)
    with pytest.raises(ConfigError, match=r"does not define \(it has: default\)"):
        tenants.check_egress({"default"})


def test_serve_takes_tokens_admin_tokens_and_quota_wait(tmp_path, monkeypatch):
    for name in ("CLOCHE_TOKENS", "CLOCHE_ADMIN_TOKEN", "CLOCHE_QUOTA_WAIT"):
        monkeypatch.delenv(name, raising=False)
    path = good_file(tmp_path)
    args = build_parser().parse_args(
        ["serve", "--tokens", str(path), "--admin-token", "a1", "--admin-token", "a2"]
        + ["--token", "u1", "--quota-wait", "2.5"]
    )
    config = config_from_args(args)
    assert config.tokens_file == path and config.quota_wait_s == 2.5
    assert config.admin_tokens == {"a1", "a2"} and config.tokens == {"u1"}
    assert config_from_args(build_parser().parse_args(["serve"])).quota_wait_s == 10.0
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="--quota-wait"):
            config_from_args(build_parser().parse_args(["serve", "--quota-wait", bad]))
    monkeypatch.setenv("CLOCHE_ADMIN_TOKEN", "x,y")
    monkeypatch.setenv("CLOCHE_TOKENS", str(path))
    config = config_from_args(build_parser().parse_args(["serve"]))
    assert config.admin_tokens == {"x", "y"} and config.tokens_file == path
