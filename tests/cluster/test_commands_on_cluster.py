"""Commands and terminals' tests, against a cluster front end over a local 2-node Ray
cluster: each verb, its streams and its cancellation cross the data path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support import ServerThread, adopt, cluster_server, make_config

# Not here: a test that looks inside one machine's manager (for a request in flight).
adopt(
    "server/test_commands.py",
    globals(),
    skip=("test_a_kill_asked_as_the_sandbox_dies_is_told_the_session_is_gone",),
)
adopt("server/test_terminals.py", globals())

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def server(state_root: Path) -> Iterator[ServerThread]:
    """Two nodes; tokens t1 and t2, as on one machine."""
    config = make_config(state_root, cluster="local:2", tokens=frozenset({"t1", "t2"}), pool_size=1)
    with cluster_server(config) as running:
        running.call(running.server.manager.wait_ready("lean", 600), timeout_s=600)
        yield running
