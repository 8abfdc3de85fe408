"""The REPL TCP protocol's tests, against a cluster front end over a local 2-node Ray cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support import ServerThread, adopt, make_config, require_cluster

adopt(
    "server/test_tcp_protocol.py",
    globals(),
    skip=("test_client_that_sends_nothing_is_dropped_after_the_timeout",),
)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def server(state_root: Path) -> Iterator[ServerThread]:
    require_cluster()
    with ServerThread(make_config(state_root, cluster="local:2", pool_size=1)) as running:
        ray_temp = running.server.manager.engine.temp_dir
        yield running
    # Stopped in this process (Ray's driver stays loaded): nothing of the cluster is left.
    assert ray_temp is not None and not Path(ray_temp).exists()
    assert list(state_root.glob("node-*")) == []
