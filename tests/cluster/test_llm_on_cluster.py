"""llm_query's tests against a cluster: each node's broker calls the model for its sessions
(the key stays on the host of the node; the sandbox sees neither key nor network)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llm.conftest import llm_config
from llm.stub import StubLLM
from support import ServerThread, adopt, cluster_server, make_config

# Not here: the tests that start servers of their own with other LLM limits, and the one
# about a server without a model.
SKIP = (
    "test_concurrency_is_bounded_per_session",
    "test_llm_waiting_is_bounded_by_the_llm_timeout",
    "test_the_call_budget_stops_a_runaway_loop",
    "test_the_cell_timeout_does_not_count_llm_waiting",
    "test_the_cell_timeout_still_counts_the_cells_own_time",
    "test_the_token_budget_stops_calls",
    "test_llm_query_is_absent_without_a_backend",
)
adopt("llm/test_llm_query.py", globals(), skip=SKIP)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def stub() -> Iterator[StubLLM]:
    with StubLLM() as running:
        yield running


@pytest.fixture(autouse=True)
def _fresh_stub(stub: StubLLM) -> None:
    stub.reset()


@pytest.fixture(scope="module")
def llm_server(state_root: Path, stub: StubLLM) -> Iterator[ServerThread]:
    config = make_config(state_root, cluster="local:2", pool_size=1, llm=llm_config(stub))
    with cluster_server(config) as running:
        yield running
