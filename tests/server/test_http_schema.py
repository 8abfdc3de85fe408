"""Schemathesis against the HTTP API's own /openapi.json, served by a real gVisor server.

Every operation is fuzzed from its schema, with valid (positive) and invalid (negative)
inputs; whatever comes in, the server must never answer with a 5xx.

The cases come from schemathesis' documented Hypothesis strategies
(`schema[path][method].as_strategy(...)` under `@given`), not from
`schemathesis.pytest.from_fixture`: the server only exists once a fixture has started
it, and that lazy loader breaks on pytest 9 (it sets `node._nodeid`, which pytest 9
no longer has).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from cloche.config import Limits
from support import ServerThread, make_config, require_gvisor

EXAMPLES_PER_OPERATION = 30
# Each request may wait for a `data` sandbox to start (~3 s, far more on a loaded machine).
pytestmark = pytest.mark.timeout(300)

# Every operation the API has (checked against the schema below, so none is forgotten).
# E2B's API under /e2b (server/e2b) is kept out of cloche's schema: it is E2B's, specified by
# E2B's own OpenAPI and envd's protos; tests/e2b/test_fuzz.py fuzzes it instead.
OPERATIONS = [
    ("POST", "/"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/v1/sessions"),
    ("GET", "/v1/sessions"),
    ("GET", "/v1/sessions/{session_id}"),
    ("PATCH", "/v1/sessions/{session_id}"),
    ("DELETE", "/v1/sessions/{session_id}"),
    ("GET", "/v1/sessions/{session_id}/cells"),
    ("GET", "/v1/sessions/{session_id}/cells/{number}"),
    ("POST", "/v1/sessions/{session_id}/execute"),
    ("POST", "/v1/sessions/{session_id}/completions"),
    ("POST", "/v1/sessions/{session_id}/interrupt"),
    ("POST", "/v1/sessions/{session_id}/input"),
    ("POST", "/v1/sessions/{session_id}/restart"),
    ("GET", "/v1/sessions/{session_id}/files"),
    ("GET", "/v1/sessions/{session_id}/files/{path}"),
    ("PUT", "/v1/sessions/{session_id}/files/{path}"),
    ("PUT", "/v1/sessions/{session_id}/context"),
    ("POST", "/v1/sessions/{session_id}/packages"),
    ("POST", "/v1/sessions/{session_id}/snapshot"),
    ("POST", "/v1/sessions/{session_id}/fork"),
    ("POST", "/v1/sessions/{session_id}/pause"),
    ("POST", "/v1/sessions/{session_id}/resume"),
    ("POST", "/v1/sessions/{session_id}/commands"),
    ("GET", "/v1/sessions/{session_id}/commands"),
    ("GET", "/v1/sessions/{session_id}/commands/{pid}"),
    ("DELETE", "/v1/sessions/{session_id}/commands/{pid}"),
    ("POST", "/v1/sessions/{session_id}/commands/{pid}/stdin"),
    ("POST", "/v1/sessions/{session_id}/commands/{pid}/signal"),
    ("GET", "/v1/sessions/{session_id}/ports"),
    ("POST", "/v1/sessions/{session_id}/ports/{port}/url"),
    ("GET", "/v1/snapshots"),
    ("GET", "/v1/snapshots/{snapshot_id}"),
    ("DELETE", "/v1/snapshots/{snapshot_id}"),
    ("GET", "/v1/profiles"),
    ("POST", "/v1/templates"),
    ("GET", "/v1/templates"),
    ("GET", "/v1/templates/{name}"),
    ("DELETE", "/v1/templates/{name}"),
    ("POST", "/v1/volumes"),
    ("GET", "/v1/volumes"),
    ("GET", "/v1/volumes/{name}"),
    ("DELETE", "/v1/volumes/{name}"),
    ("GET", "/v1/volumes/{name}/files"),
    ("GET", "/v1/volumes/{name}/files/{path}"),
    ("PUT", "/v1/volumes/{name}/files/{path}"),
    ("DELETE", "/v1/volumes/{name}/files/{path}"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/cluster"),
    ("POST", "/v1/cluster/nodes/{node_id}/drain"),
    ("POST", "/v1/cluster/nodes/{node_id}/resume"),
    ("GET", "/v1/events"),
]
# Streams that never end by themselves: schemathesis reads an event stream until the
# request's read timeout passes with nothing sent (here, between heartbeats).
STREAM_READ_TIMEOUT_S = {"/v1/events": 1.0}


@pytest.fixture(scope="module")
def fuzzed(state_root) -> Iterator[ServerThread]:
    require_gvisor()
    config = make_config(
        state_root,
        pool_size=2,
        data_pool_size=2,
        # Fuzzed code that happens to loop must not hold the run up for long.
        limits=Limits(cell_timeout_s=5, interrupt_grace_s=1),
        # Volumes are allocated in full: fuzzed sizes stay small.
        volume_max_mib=16,
    )
    with ServerThread(config) as running:
        running.call(running.server.manager.pools["data"].wait_full(600), timeout_s=600)
        yield running


@pytest.fixture(scope="module")
def api_schema(fuzzed: ServerThread) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"http://127.0.0.1:{fuzzed.http_port}/openapi.json")


@pytest.fixture(scope="module")
def http_session() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


@pytest.fixture
def live_session(fuzzed: ServerThread, http_session: requests.Session) -> Iterator[str]:
    """A real session, so that operations on one get past "not found"."""
    base = f"http://127.0.0.1:{fuzzed.http_port}/v1/sessions"
    session_id: str = http_session.post(base).json()["id"]
    yield session_id
    http_session.delete(f"{base}/{session_id}")  # 404 if the fuzzer deleted it: fine


@pytest.fixture
def live_volume(fuzzed: ServerThread, http_session: requests.Session) -> Iterator[str]:
    """A real volume, so that operations on one get past "not found"."""
    base = f"http://127.0.0.1:{fuzzed.http_port}/v1/volumes"
    http_session.post(base, json={"name": "fuzzed", "size_mib": 4})  # 409 if left: fine
    yield "fuzzed"


def test_the_schema_has_exactly_the_operations_fuzzed_here(api_schema):
    found = {
        (result.ok().method.upper(), result.ok().path) for result in api_schema.get_all_operations()
    }
    assert found == set(OPERATIONS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_input_makes_a_server_error(
    api_schema, http_session, live_session, live_volume, method, path
):
    operation = api_schema[path][method]
    # Valid and invalid cases mixed. Where nothing can be made invalid (no parameters, or
    # only string path parameters: every value is a valid string), the negative strategy
    # rejects every draw and the positive one supplies all the cases.
    fixed: list[dict[str, Any]] = [{}]
    if "{session_id}" in path:
        # Random ids only ever meet "not found": half the cases aim at a live session.
        fixed.append({"path_parameters": {"session_id": live_session}})
    if path.startswith("/v1/volumes/{name}"):
        fixed.append({"path_parameters": {"name": live_volume}})
    cases = st.one_of(
        operation.as_strategy(generation_mode=mode, **parameters)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        for parameters in fixed
    )

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(case=cases)
    def fuzz(case: schemathesis.Case) -> None:
        read_timeout_s = STREAM_READ_TIMEOUT_S.get(path, 120)
        response = case.call(session=http_session, timeout=(120, read_timeout_s))
        try:
            case.validate_response(response, checks=[not_a_server_error])
        finally:
            if (method, path) == ("POST", "/v1/sessions") and response.status_code == 201:
                # The sessions it makes would otherwise pile up to --max-sessions.
                session_id = response.json()["id"]
                http_session.delete(f"{case.operation.base_url}/v1/sessions/{session_id}")
            if (method, path) == ("POST", "/v1/volumes") and response.status_code == 201:
                name = response.json()["name"]
                http_session.delete(f"{case.operation.base_url}/v1/volumes/{name}")

    fuzz()
