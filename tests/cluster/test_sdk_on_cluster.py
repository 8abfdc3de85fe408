"""The client SDK's tests against a cluster front end (with a token), as against one machine."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import cloche
from support import ServerThread, adopt, make_config, require_cluster

TOKEN = "client-token"
# Not here: tests that look inside one machine's manager.
SKIP = (
    "test_a_cell_still_waiting_when_its_session_closes_raises",
    "test_one_shot_run_takes_files_and_returns_the_ones_it_made",
)
adopt("client/test_sync.py", globals(), skip=SKIP)

pytestmark = pytest.mark.cluster


@pytest.fixture(autouse=True)
def no_cloche_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("CLOCHE_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def api_server(state_root: Path) -> Iterator[ServerThread]:
    require_cluster()
    config = make_config(state_root, cluster="local:2", tokens=frozenset({TOKEN}), pool_size=1)
    with ServerThread(config) as running:
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
def no_session_left_behind(url: str) -> Iterator[None]:
    """Every test closes what it opens, on every node."""
    yield
    listing = httpx.get(f"{url}/v1/sessions", headers={"Authorization": f"Bearer {TOKEN}"})
    assert listing.json()["sessions"] == []
