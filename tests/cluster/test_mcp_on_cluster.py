"""The MCP server's tests (stdio against the HTTP API, and /mcp inside the server), against
a cluster front end over a local 2-node Ray cluster, with a token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support import ServerThread, adopt, cluster_server, make_config

TOKEN = "mcp-token"
# Not here: tests that look inside one machine's manager, the one that starts servers of its
# own, and volumes (one machine's: a cluster answers NotSupported, tests/cluster/
# test_volumes_not_here.py).
SKIP = (
    "test_volumes_are_made_filled_mounted_and_deleted_by_tools",
    "test_state_persists_in_the_connections_own_session",
    "test_each_connection_gets_its_own_session",
    "test_a_session_is_snapshotted_restored_and_forked_by_tools",
    "test_the_2026_protocol_has_no_connections_so_state_needs_a_named_session",
    "test_sessions_made_over_mcp_belong_to_the_token",
    "test_a_connected_client_does_not_hold_up_the_servers_shutdown",
)
adopt("server/test_mcp.py", globals(), skip=SKIP)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def api(state_root: Path) -> Iterator[ServerThread]:
    config = make_config(state_root, cluster="local:2", tokens=frozenset({TOKEN}), pool_size=1)
    with cluster_server(config) as running:
        yield running


@pytest.fixture
def url(api: ServerThread) -> Iterator[str]:
    base = f"http://127.0.0.1:{api.http_port}"
    yield base
    listing = httpx.get(f"{base}/v1/sessions", headers={"Authorization": f"Bearer {TOKEN}"})
    assert listing.json()["sessions"] == [], "a session outlived its MCP connection"
