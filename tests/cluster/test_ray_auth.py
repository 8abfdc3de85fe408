"""A local cluster's Ray token: a private file, given to Ray through the environment, and
taken back with every trace of it; a GCS that can't be asked is a clear error."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from cloche.cluster import ray_auth
from cloche.errors import ConfigError
from support import require_cluster


def test_a_cluster_token_is_a_private_file_used_then_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_cluster()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "the-operator-s-own")
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    token = ray_auth.ClusterToken(tmp_path / "state")
    assert token.path.parent == tmp_path / "state"
    assert token.path.stat().st_mode & 0o777 == 0o600
    assert len(token.path.read_text()) >= 40  # 256 bits, url-safe
    token.use()
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(token.path)
    assert "RAY_AUTH_TOKEN" not in os.environ  # it would win over the file
    token.forget()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
    assert os.environ["RAY_AUTH_TOKEN"] == "the-operator-s-own"
    assert "RAY_AUTH_TOKEN_PATH" not in os.environ
    assert not token.path.exists()
    token.forget()  # twice is harmless


def test_two_tokens_are_never_the_same(tmp_path: Path) -> None:
    first, second = ray_auth.ClusterToken(tmp_path), ray_auth.ClusterToken(tmp_path)
    assert first.path != second.path
    assert first.path.read_text() != second.path.read_text()
    first.forget()
    second.forget()
    assert list(tmp_path.iterdir()) == []


def test_a_gcs_that_answers_nothing_ray_knows_is_a_clear_error() -> None:
    require_cluster()
    with socket.socket() as silent:  # listens, never speaks gRPC
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(ConfigError, match=f"Ray cluster at {address}"):
            ray_auth.requires_token(address, timeout_s=5)
