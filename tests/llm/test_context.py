"""A session's context: streamed into its working directory, loaded as `context`."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from cloche.config import MIB, Limits
from support import ServerThread

LIMITS = Limits(cell_timeout_s=30.0, interrupt_grace_s=1.0, disk_mib=16, memory_mib=1024)


@pytest.fixture(scope="module")
def small_frames(state_root) -> Iterator[ServerThread]:
    """No LLM backend, frames of 1 MiB, a working directory of 16 MiB: a context larger
    than a frame can only have come through the file."""
    from support import make_config, require_gvisor

    require_gvisor()
    config = make_config(state_root, limits=LIMITS, max_frame_bytes=MIB, pool_size=1)
    with ServerThread(config) as running:
        yield running


@pytest.fixture
def http(small_frames: ServerThread) -> Iterator[httpx.Client]:
    base = f"http://127.0.0.1:{small_frames.http_port}"
    with httpx.Client(base_url=base, timeout=60) as client:
        yield client


@pytest.fixture
def session(http: httpx.Client) -> Iterator[str]:
    session_id: str = http.post("/v1/sessions").json()["id"]
    yield session_id
    http.delete(f"/v1/sessions/{session_id}")


def execute(http: httpx.Client, session: str, code: str) -> dict[str, object]:
    answer = http.post(f"/v1/sessions/{session}/execute", json={"code": code})
    assert answer.status_code == 200, answer.text
    result: dict[str, object] = answer.json()
    return result


def chunks(total_bytes: int, line: bytes = b"lorem ipsum dolor sit amet\n") -> Iterator[bytes]:
    """A body streamed in 64 KiB pieces."""
    data = (line * (total_bytes // len(line) + 1))[:total_bytes]
    for start in range(0, len(data), 1 << 16):
        yield data[start : start + (1 << 16)]


def test_a_context_larger_than_a_frame_is_streamed_into_context(http, session):
    size = 3 * MIB
    answer = http.put(f"/v1/sessions/{session}/context", content=chunks(size))
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"kind": "text", "file": "context.txt", "size_bytes": size}
    result = execute(http, session, "[type(context).__name__, len(context), context[:12]]")
    assert result["result_json"] == ["str", size, "lorem ipsum "]


def test_loading_is_silent(http, session):
    http.put(f"/v1/sessions/{session}/context", content=b"abc")
    assert http.get(f"/v1/sessions/{session}").json()["execution_count"] == 0
    result = execute(http, session, "context")
    assert result["result_json"] == "abc"
    assert result["execution_count"] == 1
    assert result["stdout"] == ""


def test_a_json_context_is_loaded_as_json(http, session):
    value = {"docs": [{"id": i, "text": f"doc {i}"} for i in range(1000)]}
    answer = http.put(
        f"/v1/sessions/{session}/context",
        content=json.dumps(value).encode(),
        headers={"content-type": "application/json"},
    )
    assert answer.json()["kind"] == "json"
    assert execute(http, session, "context['docs'][999]")["result_json"] == {
        "id": 999,
        "text": "doc 999",
    }
    answer = http.put(f"/v1/sessions/{session}/context?format=json", content=b"[1, 2]")
    assert execute(http, session, "context")["result_json"] == [1, 2]


def test_the_context_file_is_in_the_working_directory(http, session):
    http.put(f"/v1/sessions/{session}/context", content=b"on disk")
    listing = http.get(f"/v1/sessions/{session}/files").json()["files"]
    assert [f["path"] for f in listing] == ["context.txt"]
    assert execute(http, session, "open('context.txt').read()")["result_json"] == "on disk"


def test_invalid_json_is_refused_clearly(http, session):
    answer = http.put(f"/v1/sessions/{session}/context?format=json", content=b"{not json")
    assert answer.status_code == 400
    assert "could not load it as json: JSONDecodeError" in answer.json()["error"]["message"]


def test_a_context_larger_than_the_working_directory_is_refused(http, session):
    answer = http.put(f"/v1/sessions/{session}/context", content=chunks(17 * MIB))
    assert answer.status_code == 413, answer.text
    assert execute(http, session, "'context' in globals()")["result_json"] is False
    files = http.get(f"/v1/sessions/{session}/files").json()["files"]
    assert files == []  # the partial upload was removed


def test_a_context_can_be_given_at_creation(http):
    answer = http.post("/v1/sessions", json={"context": {"question": "why", "n": [1, 2]}})
    assert answer.status_code == 201, answer.text
    session = answer.json()["id"]
    try:
        assert execute(http, session, "context")["result_json"] == {"question": "why", "n": [1, 2]}
        assert answer.json()["execution_count"] == 0
    finally:
        http.delete(f"/v1/sessions/{session}")


def test_another_owner_cant_put_a_context(http):
    answer = http.put("/v1/sessions/0123456789abcdef0123456789abcdef/context", content=b"x")
    assert answer.status_code == 404
