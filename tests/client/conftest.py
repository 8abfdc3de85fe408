"""The client SDK's tests run against one real gVisor server with a token."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import cloche
from support import ServerThread, make_config, require_gvisor

TOKEN = "client-token"


@pytest.fixture(autouse=True)
def no_cloche_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's CLOCHE_URL / CLOCHE_TOKEN must not change what these tests see."""
    for name in list(os.environ):
        if name.startswith("CLOCHE_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="package")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    require_gvisor()
    state = tmp_path_factory.mktemp("client-state")
    with ServerThread(make_config(state, tokens=frozenset({TOKEN}), pool_size=2)) as running:
        yield running


@pytest.fixture
def token() -> str:
    return TOKEN


@pytest.fixture
def url(api_server: ServerThread) -> str:
    return f"http://127.0.0.1:{api_server.http_port}"


@pytest.fixture
def client(url: str) -> Iterator[cloche.Client]:
    with cloche.Client(url, TOKEN) as connected:
        yield connected


@pytest.fixture
def session(client: cloche.Client) -> Iterator[cloche.Session]:
    with client.create_session() as opened:
        yield opened


@pytest.fixture(autouse=True)
def no_session_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test closes what it opens (fixtures included)."""
    yield
    if "api_server" in request.fixturenames:
        server: ServerThread = request.getfixturevalue("api_server")
        assert server.server.manager.list(TOKEN) == []
