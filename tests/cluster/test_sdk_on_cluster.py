"""The client SDK's tests against a cluster front end (with a token), as against one machine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support import ServerThread, adopt, cluster_server, make_config

TOKEN = "client-token"
# Not here: tests that look inside one machine's manager.
SKIP = (
    "test_a_cell_still_waiting_when_its_session_closes_raises",
    "test_one_shot_run_takes_files_and_returns_the_ones_it_made",
)
adopt("client/test_sync.py", globals(), skip=SKIP)
adopt("client/conftest.py", globals())  # its fixtures; the server and the check are ours

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def api_server(state_root: Path) -> Iterator[ServerThread]:
    config = make_config(state_root, cluster="local:2", tokens=frozenset({TOKEN}), pool_size=1)
    with cluster_server(config) as running:
        yield running


@pytest.fixture(autouse=True)
def no_session_left_behind(url: str) -> Iterator[None]:
    """Every test closes what it opens, on every node."""
    yield
    listing = httpx.get(f"{url}/v1/sessions", headers={"Authorization": f"Bearer {TOKEN}"})
    assert listing.json()["sessions"] == []
