"""The REPL TCP protocol's tests, against a cluster front end over a local 2-node Ray cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support import ServerThread, adopt, cluster_server, make_config

adopt(
    "server/test_tcp_protocol.py",
    globals(),
    skip=("test_client_that_sends_nothing_is_dropped_after_the_timeout",),
)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def server(state_root: Path) -> Iterator[ServerThread]:
    with cluster_server(make_config(state_root, cluster="local:2", pool_size=1)) as running:
        yield running
