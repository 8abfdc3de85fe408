"""The Terrarium endpoint's tests, against a cluster front end over a local 2-node Ray cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support import ServerThread, adopt, cluster_server, make_config

# Not here: the tests that need a server of their own with eight warm sandboxes (`wide`).
SKIP = ("test_a_sleeping_cell_is_stopped_by_the_cell_timeout", "test_requests_run_in_parallel")
adopt("server/test_http_terrarium.py", globals(), skip=SKIP)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def terrarium(state_root: Path) -> Iterator[ServerThread]:
    config = make_config(state_root, cluster="local:2", pool_size=0, data_pool_size=1)
    with cluster_server(config) as running:
        running.call(running.server.manager.wait_ready("data", 600), timeout_s=600)
        yield running
