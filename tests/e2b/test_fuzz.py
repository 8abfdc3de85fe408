"""E2B's routes fuzzed with Hypothesis: whatever the body, headers or query, no 5xx, and
every control-plane error in the shape the SDK reads ({"code", "message"})."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import E2B_KEY as KEY

pytestmark = [pytest.mark.gvisor, pytest.mark.timeout(600)]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "templateID": st.one_of(st.text(max_size=30), JSON),
        "timeout": st.one_of(st.integers(-10, 100000), JSON),
        "metadata": JSON,
        "envVars": JSON,
        "network": JSON,
        "allow_internet_access": JSON,
        "autoPause": JSON,
        "volumeMounts": JSON,
    },
)
CONTROL = [
    ("POST", "/v2/sandboxes"),
    ("POST", "/sandboxes"),
    ("GET", "/v2/sandboxes"),
    ("GET", "/sandboxes/{id}"),
    ("DELETE", "/sandboxes/{id}"),
    ("POST", "/sandboxes/{id}/timeout"),
    ("POST", "/sandboxes/{id}/pause"),
    ("POST", "/sandboxes/{id}/resume"),
    ("POST", "/v2/sandboxes/{id}/connect"),
    ("POST", "/sandboxes/{id}/snapshots"),
    ("POST", "/sandboxes/{id}/fork"),
    ("GET", "/snapshots"),
]
SANDBOX = [
    ("POST", "/process.Process/Start", "application/connect+json"),
    ("POST", "/process.Process/List", "application/json"),
    ("POST", "/process.Process/SendSignal", "application/json"),
    ("POST", "/filesystem.Filesystem/ListDir", "application/json"),
    ("POST", "/filesystem.Filesystem/MakeDir", "application/json"),
    ("GET", "/files", ""),
    ("POST", "/files", "application/octet-stream"),
    ("POST", "/execute", "application/json"),
    ("POST", "/contexts", "application/json"),
]


@pytest.fixture(scope="module")
def made(e2b_env: dict[str, str]) -> dict[str, Any]:
    """A sandbox to aim at (the body of a create, with its tokens)."""
    with httpx.Client(headers={"X-API-KEY": KEY}, timeout=120) as http:
        reply = http.post(f"{e2b_env['E2B_API_URL']}/v2/sandboxes", json={"templateID": "base"})
        assert reply.status_code == 201, reply.text
        yield reply.json()
        http.delete(f"{e2b_env['E2B_API_URL']}/sandboxes/{reply.json()['sandboxID']}")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    route=st.sampled_from(CONTROL),
    body=st.one_of(FIELDS, JSON, st.binary(max_size=64)),
    real_id=st.booleans(),
    query=st.dictionaries(
        st.sampled_from(["state", "limit", "nextToken", "metadata", "order"]),
        st.text(max_size=12),
        max_size=3,
    ),
)
def test_control_plane_never_fails_and_errors_keep_the_shape(
    e2b_env: dict[str, str],
    made: dict[str, Any],
    route: tuple[str, str],
    body: Any,
    real_id: bool,
    query: dict[str, str],
) -> None:
    method, path = route
    if method in ("DELETE", "POST") and real_id and path.endswith("{id}"):
        real_id = False  # keep the sandbox for the other examples
    url = e2b_env["E2B_API_URL"] + path.replace("{id}", made["sandboxID"] if real_id else "x1")
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(headers={"X-API-KEY": KEY}, timeout=120) as http:
        reply = http.request(method, url, content=content, params=query)
    assert reply.status_code < 500, (route, body, reply.text)
    if reply.status_code >= 400:
        error = reply.json()
        assert set(error) == {"code", "message"} and error["code"] == reply.status_code
    elif reply.status_code == 201 and path.endswith("sandboxes"):
        with httpx.Client(headers={"X-API-KEY": KEY}, timeout=120) as http:
            http.delete(f"{e2b_env['E2B_API_URL']}/sandboxes/{reply.json()['sandboxID']}")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    route=st.sampled_from(SANDBOX),
    body=st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=64)),
    token=st.sampled_from(["right", "wrong", "none"]),
    port=st.sampled_from(["49983", "49999", "8080", "x"]),
)
def test_sandbox_routes_never_fail(
    e2b_env: dict[str, str],
    made: dict[str, Any],
    route: tuple[str, str, str],
    body: bytes,
    token: str,
    port: str,
) -> None:
    method, path, kind = route
    headers = {"E2b-Sandbox-Id": made["sandboxID"], "E2b-Sandbox-Port": port}
    if kind:
        headers["Content-Type"] = kind
    if token != "none":
        headers["X-Access-Token"] = made["envdAccessToken"] if token == "right" else "no"
        headers["E2B-Traffic-Access-Token"] = (
            made["trafficAccessToken"] if token == "right" else "no"
        )
    url = e2b_env["E2B_SANDBOX_URL"] + path
    with httpx.Client(timeout=120) as http:
        reply = http.request(method, url, content=body, headers=headers, params={"path": "/tmp/f"})
    assert reply.status_code < 500 or (port not in ("49983", "49999") and reply.status_code == 502)
