"""The sessions API's tests, against a cluster front end over a local 2-node Ray cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support import ServerThread, adopt, cluster_server, make_config

# Not here: tests of one machine's limits (--max-sessions, queue, body size, on servers of
# their own) and tests that look inside one machine's manager.
SKIP = (
    # Its server has one waiting cell per session: on a cluster, tests/cluster/test_busy.py
    # (a second Ray cluster can't live in this process beside the module's).
    "test_a_session_with_a_full_queue_is_busy",
    "test_bodies_over_the_limit_are_too_large",
    "test_leaving_a_stream_whose_cell_waits_spares_the_running_cell",
    "test_too_many_sessions",
    # Sandbox figures are the nodes' (cloche_cluster_node_*), not the front end's.
    "test_metrics_tell_sessions_cells_starts_and_closes",
)
adopt("server/test_http_sessions.py", globals(), skip=SKIP)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def guarded(state_root: Path) -> Iterator[ServerThread]:
    """Two nodes; tokens t1 and t2, as on one machine."""
    config = make_config(
        state_root,
        cluster="local:2",
        tokens=frozenset({"t1", "t2"}),
        pool_size=1,
        data_pool_size=1,
    )
    with cluster_server(config) as running:
        running.call(running.server.manager.wait_ready("data", 600), timeout_s=600)
        yield running
