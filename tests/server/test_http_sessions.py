"""The sessions API (`/v1/sessions`) end to end over HTTP, against a real gVisor server."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloche.config import Limits
from support import ServerThread, make_config, require_gvisor, sse_events

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T1 = {"Authorization": "Bearer t1"}
T2 = {"Authorization": "Bearer t2"}
MAX_CELL_TIMEOUT_S = 20.0  # make_config's default --cell-timeout
SMALL_BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def guarded(state_root) -> Iterator[ServerThread]:
    """The server most tests share; it has two tokens, t1 and t2."""
    require_gvisor()
    config = make_config(state_root, tokens=frozenset({"t1", "t2"}), pool_size=2, data_pool_size=1)
    with ServerThread(config) as running:
        running.call(running.server.manager.pools["data"].wait_full(600), timeout_s=600)
        yield running


@pytest.fixture(scope="module")
def small(state_root) -> Iterator[ServerThread]:
    """Two sessions at most, one waiting cell per session, 64 KiB bodies; no tokens."""
    require_gvisor()
    config = make_config(
        state_root,
        pool_size=1,
        max_sessions=2,
        max_queued_cells=1,
        max_frame_bytes=SMALL_BODY_LIMIT,
        # No page-out: at --max-sessions, nothing makes room.
        limits=Limits(cell_timeout_s=20.0, interrupt_grace_s=1.0, pause_idle_s=0),
    )
    with ServerThread(config) as running:
        yield running


def client_of(server: ServerThread, headers: dict[str, str] | None = None) -> httpx.Client:
    return httpx.Client(
        base_url=f"http://127.0.0.1:{server.http_port}", headers=headers or {}, timeout=60
    )


@pytest.fixture(scope="module")
def http(guarded) -> Iterator[httpx.Client]:
    """A client with token t1."""
    with client_of(guarded, T1) as client:
        yield client


@pytest.fixture
def session(http) -> Iterator[str]:
    """A fresh lean session of t1, closed afterwards."""
    response = http.post("/v1/sessions")
    assert response.status_code == 201, response.text
    session_id = response.json()["id"]
    yield session_id
    http.delete(f"/v1/sessions/{session_id}")


def execute(client: httpx.Client, session_id: str, code: str, **extra: Any) -> dict[str, Any]:
    response = client.post(f"/v1/sessions/{session_id}/execute", json={"code": code, **extra})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def file_exists(client: httpx.Client, session_id: str, path: str) -> bool:
    return client.get(f"/v1/sessions/{session_id}/files/{path}").status_code == 200


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    """A figure of /metrics with these labels, summed over any others (a cluster's `node`);
    0 when it is not there yet."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def error_of(response: httpx.Response) -> dict[str, str]:
    body = response.json()
    assert set(body) == {"error"}, body
    assert body["error"]["type"] and body["error"]["message"]
    error: dict[str, str] = body["error"]
    return error


# --- sessions: create, list, get, delete ------------------------------------------------


def test_a_new_session_describes_itself(http):
    before = datetime.datetime.now(datetime.UTC)
    response = http.post("/v1/sessions")
    assert response.status_code == 201
    body = response.json()
    try:
        assert uuid.UUID(body["id"]).version == 4  # a kernel id jupyter_server routes accept
        assert str(uuid.UUID(body["id"])) == body["id"]
        assert body["profile"] == "lean"
        assert body["state"] == "idle"
        assert body["execution_count"] == 0
        created = datetime.datetime.fromisoformat(body["created_at"])
        expires = datetime.datetime.fromisoformat(body["expires_at"])
        assert before - datetime.timedelta(seconds=5) <= created <= expires
        assert body["limits"] == {
            "cell_timeout_s": MAX_CELL_TIMEOUT_S,
            "memory_mib": 1024,
            "disk_mib": 256,
            "output_bytes": 1024 * 1024,
            "nproc": 64,
            "idle_timeout_s": 1800.0,
            "lifetime_s": 86400.0,
        }
        idle = (expires - created).total_seconds()
        assert abs(idle - 1800) < 0.001  # the idle timeout, to the microsecond's rounding
        assert http.get(f"/v1/sessions/{body['id']}").json() == body
    finally:
        http.delete(f"/v1/sessions/{body['id']}")


def test_a_session_timeout_is_capped_by_the_servers_maximum(http):
    short = http.post("/v1/sessions", json={"timeout": 2.5}).json()
    long = http.post("/v1/sessions", json={"timeout": 1e9}).json()
    try:
        assert short["limits"]["cell_timeout_s"] == 2.5
        assert long["limits"]["cell_timeout_s"] == MAX_CELL_TIMEOUT_S
    finally:
        http.delete(f"/v1/sessions/{short['id']}")
        http.delete(f"/v1/sessions/{long['id']}")


def test_env_vars_and_initial_files_are_there_from_the_start(http):
    response = http.post(
        "/v1/sessions",
        json={
            "env": {"CLOCHE_GREETING": "hello", "CLOCHE_QUOTED": 'it\'s "x"\n'},
            "files": [
                {"filename": "top.txt", "b64_data": base64.b64encode(b"top").decode()},
                {"filename": "a/b/deep.bin", "b64_data": base64.b64encode(b"\0\1\2").decode()},
            ],
        },
    )
    assert response.status_code == 201, response.text
    session_id = response.json()["id"]
    try:
        # The setup left nothing behind in the namespace and counted no cell.
        assert response.json()["execution_count"] == 0
        result = execute(
            http,
            session_id,
            "import os\n[os.environ['CLOCHE_GREETING'], os.environ['CLOCHE_QUOTED'],"
            " open('top.txt').read(), list(open('a/b/deep.bin', 'rb').read())]",
        )
        assert result["result_json"] == ["hello", 'it\'s "x"\n', "top", [0, 1, 2]]
        assert result["execution_count"] == 1
        listing = http.get(f"/v1/sessions/{session_id}/files").json()
        assert [f["path"] for f in listing["files"]] == ["a/b/deep.bin", "top.txt"]
    finally:
        http.delete(f"/v1/sessions/{session_id}")


def test_a_data_session_has_the_data_stack_and_shows_figures(http):
    response = http.post("/v1/sessions", json={"profile": "data"})
    assert response.status_code == 201, response.text
    assert response.json()["profile"] == "data"
    session_id = response.json()["id"]
    try:
        result = execute(
            http,
            session_id,
            "import sys\nimport matplotlib.pyplot as plt\nimport pandas as pd\n"
            "plt.plot([1, 2, 3], [3, 1, 2])\nplt.title('a line')\n"
            "pd.DataFrame({'a': [1, 2]})",
        )
        assert result["status"] == "ok", result
        assert "text/html" in result["result"]  # the DataFrame's own HTML
        assert result["result_json"] is None
        [figure] = [d for d in result["displays"] if "image/png" in d]
        assert base64.b64decode(figure["image/png"]).startswith(PNG_MAGIC)
    finally:
        http.delete(f"/v1/sessions/{session_id}")


def test_list_get_and_delete(http):
    ids = [http.post("/v1/sessions").json()["id"] for _ in range(2)]
    try:
        listed = {s["id"]: s for s in http.get("/v1/sessions").json()["sessions"]}
        assert set(ids) <= set(listed)
        usage = ("cpu_s", "memory_bytes")  # in listings only (cgroup reads)
        for session_id in ids:
            one = http.get(f"/v1/sessions/{session_id}").json()
            assert {k: v for k, v in one.items() if k not in usage} == {
                k: v for k, v in listed[session_id].items() if k not in usage
            }
            assert one["cpu_s"] is None and one["memory_bytes"] is None
    finally:
        for session_id in ids:
            response = http.delete(f"/v1/sessions/{session_id}")
            assert response.status_code == 204
            assert response.content == b""
    for session_id in ids:
        assert http.get(f"/v1/sessions/{session_id}").status_code == 404
        assert http.delete(f"/v1/sessions/{session_id}").status_code == 404
        assert execute_status(http, session_id) == 404
    assert not set(ids) & {s["id"] for s in http.get("/v1/sessions").json()["sessions"]}


def execute_status(client: httpx.Client, session_id: str) -> int:
    return client.post(f"/v1/sessions/{session_id}/execute", json={"code": "1"}).status_code


# --- running cells --------------------------------------------------------------------


def test_execute_answers_the_full_result(http, session):
    result = execute(
        http,
        session,
        "import sys\nprint('out')\nprint('err', file=sys.stderr)\n"
        "open('made.txt', 'w').write('x')\ndisplay({'shown': True})\n{'a': [1, 2]}",
    )
    assert result["status"] == "ok"
    assert result["stdout"] == "out\n"
    assert result["stderr"] == "err\n"
    assert result["result"] == {"text/plain": "{'a': [1, 2]}"}
    assert result["result_json"] == {"a": [1, 2]}
    assert result["displays"] == [{"text/plain": "{'shown': True}"}]
    assert result["error"] is None
    assert result["files"] == ["made.txt"]
    assert 0 < result["duration_ms"] < 10_000
    assert result["execution_count"] == 1
    assert result["session_alive"] is True
    # State is kept between cells; an unchanged file is not listed again.
    again = execute(http, session, "open('made.txt', 'a').write('y')\nopen('new.txt', 'w')\n_")
    assert again["files"] == ["made.txt", "new.txt"]
    assert again["result_json"] == {"a": [1, 2]}
    assert again["execution_count"] == 2
    assert http.get(f"/v1/sessions/{session}").json()["execution_count"] == 2


def test_an_exception_is_the_cells_error(http, session):
    result = execute(http, session, "print('before')\ndef f():\n    raise ValueError('boom')\nf()")
    assert result["status"] == "error"
    assert result["stdout"] == "before\n"
    assert result["result"] is None
    error = result["error"]
    assert error["ename"] == "ValueError"
    assert error["evalue"] == "boom"
    assert isinstance(error["traceback"], list)
    text = "\n".join(error["traceback"])
    assert "line 3" in text and "raise ValueError('boom')" in text
    assert "cloche" not in text  # the user's frames, not the kernel's
    assert result["session_alive"] is True
    syntax = execute(http, session, "def (:")
    assert syntax["status"] == "error" and syntax["error"]["ename"] == "SyntaxError"


def test_completions_is_an_alias_of_execute(http, session):
    response = http.post(f"/v1/sessions/{session}/completions", json={"code": "x = 20\nx * 2 + 2"})
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["result_json"] == 42
    assert execute(http, session, "x")["result_json"] == 20


def test_a_cell_over_its_timeout_is_stopped_and_counted(http):
    breaches = metric(http, "cloche_limit_breaches_total", kind="timeout")
    session_id = http.post("/v1/sessions", json={"timeout": 1.5}).json()["id"]
    try:
        started = time.monotonic()
        result = execute(http, session_id, "import time\ntime.sleep(60)")
        assert time.monotonic() - started < MAX_CELL_TIMEOUT_S
        assert result["status"] == "timeout"
        assert "1.5 s" in result["message"]
        assert result["session_alive"] is True
        # A timeout given with the cell wins over the session's, within the maximum.
        assert execute(http, session_id, "1", timeout=30)["result_json"] == 1
        quick = execute(http, session_id, "import time\ntime.sleep(60)", timeout=0.5)
        assert quick["status"] == "timeout" and "0.5 s" in quick["message"]
    finally:
        http.delete(f"/v1/sessions/{session_id}")
    assert metric(http, "cloche_limit_breaches_total", kind="timeout") == breaches + 2


# --- streaming ------------------------------------------------------------------------


def test_output_is_streamed_as_it_happens(guarded, http, session):
    """The cell waits for a file the test writes only after it saw the first output."""
    code = (
        "import os, time\nprint('first', flush=True)\n"
        "while not os.path.exists('go'):\n    time.sleep(0.01)\n"
        "print('second', flush=True)\n"
    )
    seen: list[tuple[str, Any]] = []
    with (
        client_of(guarded, T1) as other,
        http.stream(
            "POST",
            f"/v1/sessions/{session}/execute",
            json={"code": code},
            headers={"Accept": "text/event-stream"},
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        stdout = ""
        for name, data in sse_events(response):
            seen.append((name, data))
            if name == "stdout":
                stdout += data["text"]
                if "first" in stdout and "second" not in stdout:
                    put = other.put(f"/v1/sessions/{session}/files/go", content=b"")
                    assert put.status_code == 204
    kinds = [name for name, _ in seen]
    assert kinds[-1] == "done"
    assert set(kinds[:-1]) == {"stdout"}
    assert "".join(data["text"] for name, data in seen if name == "stdout") == "first\nsecond\n"
    done = seen[-1][1]
    assert done["status"] == "ok"
    assert done["stdout"] == "first\nsecond\n"
    assert done["files"] == ["go"]


def test_a_stream_ends_with_result_error_and_done_events(http, session):
    with http.stream(
        "POST",
        f"/v1/sessions/{session}/execute",
        params={"stream": "true"},
        json={"code": "import sys\nprint('a')\nprint('b', file=sys.stderr)\n40 + 2"},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        seen = list(sse_events(response))
    assert [name for name, _ in seen] == ["stdout", "stderr", "result", "done"]
    assert seen[0][1] == {"text": "a\n"}
    assert seen[1][1] == {"text": "b\n"}
    assert seen[2][1] == {"text/plain": "42"}
    assert seen[3][1]["result_json"] == 42
    with http.stream(
        "POST",
        f"/v1/sessions/{session}/completions",
        headers={"Accept": "text/event-stream"},
        json={"code": "1 / 0"},
    ) as response:
        seen = list(sse_events(response))
    assert [name for name, _ in seen] == ["error", "done"]
    assert seen[0][1]["ename"] == "ZeroDivisionError"
    assert seen[1][1]["status"] == "error"


def test_a_client_that_goes_away_interrupts_its_cell(guarded, http, session):
    interrupted = metric(http, "cloche_cells_total", status="interrupted")
    code = (
        "import time\ncount = 0\nprint('counting', flush=True)\n"
        "while True:\n    count += 1\n    time.sleep(0.005)\n"
    )
    with client_of(guarded, T1) as leaving:
        with leaving.stream(
            "POST",
            f"/v1/sessions/{session}/execute",
            json={"code": code},
            headers={"Accept": "text/event-stream"},
        ) as response:
            for name, data in sse_events(response):
                assert (name, data) == ("stdout", {"text": "counting\n"})
                break  # and leave, closing the connection
    # Well within the 20 s cell timeout: the disconnect stopped it, not the timeout.
    wait_for(
        lambda: http.get(f"/v1/sessions/{session}").json()["state"] == "idle",
        "the cell to stop",
        timeout_s=10,
    )
    first = execute(http, session, "count")
    second = execute(http, session, "count")
    assert first["status"] == "ok"
    assert first["result_json"] > 0
    assert second["result_json"] == first["result_json"]  # the loop is not running
    assert metric(http, "cloche_cells_total", status="interrupted") == interrupted + 1


def test_leaving_a_stream_whose_cell_waits_spares_the_running_cell(guarded, http, session):
    """The disconnect takes the waiting cell out of the queue; the running one goes on."""
    answer: dict[str, Any] = {}
    blocking = (
        "import os, time\nopen('started', 'w').close()\n"
        "while not os.path.exists('go'):\n    time.sleep(0.01)\n'first'"
    )
    thread = threading.Thread(target=lambda: answer.update(execute(http, session, blocking)))
    thread.start()
    manager = guarded.server.manager
    try:
        wait_for(lambda: file_exists(http, session, "started"), "the first cell")
        with (
            client_of(guarded, T1) as leaving,
            leaving.stream(
                "POST",
                f"/v1/sessions/{session}/execute?stream=true",
                json={"code": "queued_cell_ran = True"},
            ) as response,
        ):
            assert response.status_code == 200
            wait_for(lambda: manager.get(session, "t1").queued_cells == 1, "the queued cell")
        wait_for(lambda: manager.get(session, "t1").queued_cells == 0, "the queue to empty")
    finally:
        http.put(f"/v1/sessions/{session}/files/go", content=b"")
        thread.join(30)
    assert answer["status"] == "ok", answer
    assert answer["result_json"] == "first"
    later = execute(http, session, "'queued_cell_ran' in globals()")
    assert later["result_json"] is False
    assert later["execution_count"] == answer["execution_count"] + 1


def test_the_interrupt_endpoint_stops_the_running_cell(http, session):
    assert http.post(f"/v1/sessions/{session}/interrupt").json() == {"interrupted": False}
    answer: dict[str, Any] = {}

    def run() -> None:
        answer.update(
            execute(
                http,
                session,
                "import time\nopen('started', 'w').close()\nwhile True:\n    time.sleep(0.01)",
            )
        )

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_for(lambda: file_exists(http, session, "started"), "the cell to start")
        assert http.get(f"/v1/sessions/{session}").json()["state"] == "busy"
        response = http.post(f"/v1/sessions/{session}/interrupt")
        assert response.status_code == 200
        assert response.json() == {"interrupted": True}
    finally:
        thread.join(30)
    assert answer["status"] == "interrupted"
    assert answer["error"]["ename"] == "KeyboardInterrupt"
    assert answer["session_alive"] is True
    assert execute(http, session, "'still here'")["result_json"] == "still here"


# --- files ----------------------------------------------------------------------------


def test_files_go_up_and_come_down(http, session):
    payload = bytes(range(256)) * 10
    put = http.put(f"/v1/sessions/{session}/files/data/in.bin", content=payload)
    assert put.status_code == 204
    result = execute(
        http,
        session,
        "data = open('data/in.bin', 'rb').read()\n"
        "open('data/out.txt', 'w').write(str(len(data)))\nlen(data)",
    )
    assert result["result_json"] == len(payload)
    assert result["files"] == ["data/out.txt"]
    down = http.get(f"/v1/sessions/{session}/files/data/in.bin")
    assert down.status_code == 200
    assert down.content == payload
    assert down.headers["content-type"] == "application/octet-stream"
    assert http.get(f"/v1/sessions/{session}/files/data/out.txt").content == b"2560"
    # Replacing a file, and ./ and // in paths, are fine.
    assert http.put(f"/v1/sessions/{session}/files/./data//in.bin", content=b"v2").status_code
    assert http.get(f"/v1/sessions/{session}/files/data/in.bin").content == b"v2"
    listing = http.get(f"/v1/sessions/{session}/files").json()
    assert listing["truncated"] is False
    assert {f["path"]: f["size_bytes"] for f in listing["files"]} == {
        "data/in.bin": 2,
        "data/out.txt": 4,
    }
    assert all(f["modified"] > 0 for f in listing["files"])
    missing = http.get(f"/v1/sessions/{session}/files/data/nothing.txt")
    assert missing.status_code == 404
    assert error_of(missing)["type"] == "not_found"


HOST_PASSWD = Path("/etc/passwd").read_bytes()


@pytest.mark.parametrize(
    "path",
    [
        "%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "data/%2e%2e/%2e%2e/etc/passwd",
        "..%2F..%2Fetc%2Fpasswd",
        "%2Fetc%2Fpasswd",
        "%2F%2Fetc/passwd",
    ],
)
def test_paths_out_of_the_working_directory_are_refused(http, session, path):
    for response in (
        http.get(f"/v1/sessions/{session}/files/{path}"),
        http.put(f"/v1/sessions/{session}/files/{path}", content=b"pwned"),
    ):
        assert response.status_code in (400, 404), response.text
        assert error_of(response)["type"] in ("path_refused", "not_found")
        assert b"root:" not in response.content
    assert Path("/etc/passwd").read_bytes() == HOST_PASSWD


def test_symlinks_made_in_the_sandbox_are_never_followed(http, session, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("host secret")
    result = execute(
        http,
        session,
        "import os\nos.symlink('/etc/passwd', 'passwd')\nos.symlink('/', 'root')\n"
        "os.symlink('..', 'up')\nos.mkdir('d')\nos.symlink('/etc', 'd/etc')\n"
        f"os.symlink({str(outside)!r}, 'outside.txt')\nopen('plain.txt', 'w').write('ok')",
    )
    assert result["status"] == "ok", result
    for path in ("passwd", "root/etc/passwd", "up/up/etc/passwd", "d/etc/passwd", "outside.txt"):
        response = http.get(f"/v1/sessions/{session}/files/{path}")
        assert response.status_code in (400, 404), (path, response.text)
        assert b"root:" not in response.content
        assert b"host secret" not in response.content
        written = http.put(f"/v1/sessions/{session}/files/{path}", content=b"pwned")
        assert written.status_code in (400, 404), (path, written.text)
    assert outside.read_text() == "host secret"
    assert Path("/etc/passwd").read_bytes() == HOST_PASSWD
    listing = http.get(f"/v1/sessions/{session}/files").json()
    assert [f["path"] for f in listing["files"]] == ["plain.txt"]


# --- tokens ---------------------------------------------------------------------------


def test_a_session_belongs_to_the_token_that_made_it(guarded, http, session):
    with client_of(guarded, T2) as other:
        assert session not in {s["id"] for s in other.get("/v1/sessions").json()["sessions"]}
        base = f"/v1/sessions/{session}"
        for response in (
            other.get(base),
            other.post(f"{base}/execute", json={"code": "1"}),
            other.post(f"{base}/completions", json={"code": "1"}),
            other.post(f"{base}/interrupt"),
            other.get(f"{base}/files"),
            other.get(f"{base}/files/x.txt"),
            other.put(f"{base}/files/x.txt", content=b"x"),
            other.delete(base),
        ):
            assert response.status_code == 404, response.request
            assert error_of(response) == {
                "type": "not_found",
                "message": f"Session {session} not found",
            }
    assert http.get(f"/v1/sessions/{session}").status_code == 200  # still there for t1
    assert http.get(f"/v1/sessions/{session}/files/x.txt").status_code == 404


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer t3"}, {"Authorization": "t1"}, {"Authorization": "Basic t1"}],
)
def test_without_a_valid_token_everything_is_refused(guarded, session, headers):
    with client_of(guarded, headers) as anonymous:
        for response in (
            anonymous.get("/v1/sessions"),
            anonymous.post("/v1/sessions"),
            anonymous.get(f"/v1/sessions/{session}"),
            anonymous.post(f"/v1/sessions/{session}/execute", json={"code": "1"}),
            anonymous.delete(f"/v1/sessions/{session}"),
        ):
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
            assert error_of(response)["type"] == "unauthorized"
        answer = anonymous.post("/", json={"code": "1"})
        assert answer.status_code == 401
        assert answer.text.endswith("}\n")
        assert answer.json()["success"] is False


def test_terrarium_honours_a_lowercase_bearer(guarded):
    with client_of(guarded, {"Authorization": "bearer t2"}) as terrarium:
        answer = terrarium.post("/", json={"code": "6 * 7"})
    assert answer.status_code == 200
    assert answer.json()["final_expression"] == 42


# --- refusals -------------------------------------------------------------------------


def test_unknown_sessions_are_not_found(http):
    unknown = "0" * 32
    for response in (
        http.get(f"/v1/sessions/{unknown}"),
        http.delete(f"/v1/sessions/{unknown}"),
        http.post(f"/v1/sessions/{unknown}/execute", json={"code": "1"}),
        http.post(f"/v1/sessions/{unknown}/execute?stream=true", json={"code": "1"}),
        http.post(f"/v1/sessions/{unknown}/interrupt"),
        http.get(f"/v1/sessions/{unknown}/files"),
        http.get(f"/v1/sessions/{unknown}/files/a.txt"),
        http.put(f"/v1/sessions/{unknown}/files/a.txt", content=b"x"),
        http.get("/v1/sessions/not-even-hex"),
    ):
        assert response.status_code == 404, response.request
        assert error_of(response)["type"] == "not_found"


def test_an_unknown_profile_is_a_bad_request(http, guarded):
    created = guarded.server.manager.created
    response = http.post("/v1/sessions", json={"profile": "gpu"})
    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request"
    assert "profile" in error_of(response)["message"]
    assert guarded.server.manager.created == created


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[]",
        b'"code"',
        b'{"timeout": 0}',
        b'{"timeout": -1}',
        b'{"timeout": "soon"}',
        b'{"profile": 1}',
        b'{"unknown": 1}',
        b'{"env": {"A": 1}}',
        b'{"env": []}',
        b'{"files": [{"filename": "a.txt"}]}',
        b'{"files": [{"filename": "a.txt", "b64_data": "not base64!"}]}',
        b'{"files": [{"filename": "../a.txt", "b64_data": ""}]}',
        b'{"files": [{"filename": "/etc/a.txt", "b64_data": ""}]}',
        b'{"files": [{"filename": "", "b64_data": ""}]}',
    ],
)
def test_invalid_session_bodies_are_bad_requests(http, guarded, body):
    created = guarded.server.manager.created
    held = len(http.get("/v1/sessions").json()["sessions"])
    response = http.post("/v1/sessions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert error_of(response)["type"] in ("invalid_request", "path_refused")
    assert guarded.server.manager.created == created  # refused before taking a sandbox
    assert len(http.get("/v1/sessions").json()["sessions"]) == held  # and none left half-made


@pytest.mark.parametrize(
    "env",
    [{"": "x"}, {"A=B": "x"}, {"NUL": "a\u0000b"}, {"\u0000": "x"}],
)
def test_env_vars_the_interpreter_refuses_are_bad_requests(http, env):
    sessions = len(http.get("/v1/sessions").json()["sessions"])
    response = http.post("/v1/sessions", json={"env": env})
    assert response.status_code == 400, response.text
    assert error_of(response)["type"] == "invalid_request"
    assert error_of(response)["message"].startswith("env "), response.text
    assert "None" not in error_of(response)["message"]
    assert len(http.get("/v1/sessions").json()["sessions"]) == sessions  # nothing left open


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"",
        b"[]",
        b"{}",
        b'{"code": 5}',
        b'{"code": null}',
        b'{"code": "1", "timeout": 0}',
        b'{"code": "1", "timeout": -3}',
        b'{"code": "1", "timeout": "x"}',
    ],
)
def test_invalid_execute_bodies_are_bad_requests(http, session, body):
    response = http.post(
        f"/v1/sessions/{session}/execute",
        content=body,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400, response.text
    assert error_of(response)["type"] == "invalid_request"
    assert execute(http, session, "'fine'")["result_json"] == "fine"


def test_code_that_is_not_valid_unicode_fails_as_a_cell(http, session):
    response = http.post(
        f"/v1/sessions/{session}/execute",
        content=b'{"code": "x = \'\\ud800\'"}',
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "error"
    assert response.json()["error"]["ename"] == "UnicodeEncodeError"
    assert execute(http, session, "'fine'")["result_json"] == "fine"


def test_a_lone_surrogate_or_a_nan_from_the_cell_still_comes_back_as_json(http, session):
    # User code can raise ValueError("\ud800") (a str UTF-8 can't encode) and offer NaN
    # in a rich output (JSON has no NaN); either used to fail the answer with a 500.
    code = (
        "class A:\n"
        "    def _repr_json_(self): return {'x': float('nan')}\n"
        "display(A())\n"
        "raise ValueError('\\ud800')"
    )
    whole = http.post(f"/v1/sessions/{session}/execute", json={"code": code})
    assert whole.status_code == 200, whole.text
    assert whole.json()["error"]["evalue"] == "\ud800"
    assert whole.json()["displays"][0]["application/json"] == {"x": None}
    with http.stream(
        "POST", f"/v1/sessions/{session}/execute?stream=true", json={"code": code}
    ) as streamed:
        seen = dict(sse_events(streamed))
    assert seen["display"]["application/json"] == {"x": None}
    assert seen["error"]["evalue"] == "\ud800"
    assert execute(http, session, "'fine'")["result_json"] == "fine"


def test_too_many_sessions(small):
    with client_of(small) as client:
        ids = []
        try:
            for _ in range(2):
                response = client.post("/v1/sessions")
                assert response.status_code == 201
                ids.append(response.json()["id"])
            refused = client.post("/v1/sessions")
            assert refused.status_code == 429
            assert error_of(refused)["type"] == "too_many_sessions"
            assert "--max-sessions" in error_of(refused)["message"]
            terrarium = client.post("/", json={"code": "1"})
            assert terrarium.status_code == 429
            assert terrarium.json()["success"] is False
            assert client.delete(f"/v1/sessions/{ids.pop()}").status_code == 204
            response = client.post("/v1/sessions")
            assert response.status_code == 201
            ids.append(response.json()["id"])
        finally:
            for session_id in ids:
                client.delete(f"/v1/sessions/{session_id}")


def test_a_session_with_a_full_queue_is_busy(small):
    with client_of(small) as client, client_of(small) as second, client_of(small) as third:
        session_id = client.post("/v1/sessions").json()["id"]
        answers: dict[str, dict[str, Any]] = {}

        def run(name: str, http: httpx.Client, code: str) -> None:
            answers[name] = execute(http, session_id, code)

        blocking = (
            "import os, time\nopen('started', 'w').close()\n"
            "while not os.path.exists('go'):\n    time.sleep(0.01)\n'first'"
        )
        threads = [threading.Thread(target=run, args=("first", client, blocking))]
        threads[0].start()
        try:
            wait_for(lambda: file_exists(third, session_id, "started"), "the first cell")
            threads.append(threading.Thread(target=run, args=("second", second, "'second'")))
            threads[1].start()
            manager = small.server.manager

            def queued() -> int:
                info = small.call(manager.info(session_id))
                return int(info.queued_cells)  # type: ignore[attr-defined]

            wait_for(lambda: queued() == 1, "the second cell")
            refused = third.post(f"/v1/sessions/{session_id}/execute", json={"code": "'third'"})
            assert refused.status_code == 409
            assert error_of(refused)["type"] == "busy"
            assert "limit 1" in error_of(refused)["message"]
            streamed = third.post(
                f"/v1/sessions/{session_id}/execute?stream=true", json={"code": "'third'"}
            )
            assert streamed.status_code == 409, streamed.text
            assert error_of(streamed)["type"] == "busy"
        finally:
            third.put(f"/v1/sessions/{session_id}/files/go", content=b"")
            for thread in threads:
                thread.join(30)
            third.delete(f"/v1/sessions/{session_id}")
        assert answers["first"]["result_json"] == "first"
        assert answers["second"]["result_json"] == "second"
        assert answers["second"]["execution_count"] == answers["first"]["execution_count"] + 1


def chunks(data: bytes, size: int = 8192) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_bodies_over_the_limit_are_too_large(small):
    big = b"x" * (SMALL_BODY_LIMIT + 1)
    code = json.dumps({"code": "'" + "x" * SMALL_BODY_LIMIT + "'"}).encode()
    with client_of(small) as client:
        session_id = client.post("/v1/sessions").json()["id"]
        try:
            files = f"/v1/sessions/{session_id}/files/big.bin"
            execute_path = f"/v1/sessions/{session_id}/execute"
            json_headers = {"Content-Type": "application/json"}
            # A file's upload is streamed into the working directory: --disk-mib bounds
            # it, not --max-frame-bytes.
            assert client.put(files, content=chunks(big)).status_code == 204
            assert len(client.get(files).content) == len(big)
            files = f"/v1/sessions/{session_id}/files/other.bin"
            for response in (
                client.post(execute_path, content=code, headers=json_headers),
                client.post(execute_path, content=chunks(code), headers=json_headers),
                client.post("/v1/sessions", content=chunks(code), headers=json_headers),
            ):
                assert response.status_code == 413, (response.request, response.text)
                assert error_of(response)["type"] == "too_large"
            for response in (
                client.post("/", content=code, headers=json_headers),
                client.post("/", content=chunks(code), headers=json_headers),
            ):
                assert response.status_code == 413, response.text
                assert response.text.count("\n") == 1 and response.text.endswith("\n")
                assert response.json()["error"]["type"] == "too_large"
            assert client.get(files).status_code == 404
        finally:
            client.delete(f"/v1/sessions/{session_id}")


# --- metrics and docs -----------------------------------------------------------------


def test_metrics_tell_sessions_cells_starts_and_closes(http):
    session_id = http.post("/v1/sessions").json()["id"]
    execute(http, session_id, "1")
    execute(http, session_id, "1 / 0")
    http.delete(f"/v1/sessions/{session_id}")
    assert http.get(f"/v1/sessions/{session_id}").status_code == 404  # a rejected request
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in (
        "cloche_sessions_active ",
        'cloche_sessions_pooled{profile="lean"} ',
        'cloche_sessions_pooled{profile="data"} ',
        'cloche_sessions_created_total{profile="lean"} ',
        'cloche_cells_total{status="ok"} ',
        'cloche_cells_total{status="error"} ',
        'cloche_cell_duration_seconds_bucket{le="0.5",status="ok"} ',
        'cloche_cell_duration_seconds_count{status="ok"} ',
        'cloche_sandbox_start_seconds_bucket{le="+Inf",profile="lean"} ',
        'cloche_sandbox_start_seconds_count{profile="data"} ',
        'cloche_sessions_closed_total{reason="deleted"} ',
        'cloche_rejected_requests_total{frontend="http",reason="not_found"} ',
    ):
        assert name in text, name
    assert metric(http, "cloche_cells_total", status="ok") >= 1
    assert metric(http, "cloche_sessions_closed_total", reason="deleted") >= 1
    active = metric(http, "cloche_sessions_active")
    assert active == len(http.get("/v1/sessions").json()["sessions"])


def test_metrics_and_health_need_no_token(guarded):
    with client_of(guarded) as anonymous:
        assert anonymous.get("/metrics").status_code == 200
        assert anonymous.get("/health").status_code == 200


def test_the_openapi_schema_and_docs_are_served(http):
    schema = http.get("/openapi.json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    for path in (
        "/",
        "/v1/sessions",
        "/v1/sessions/{session_id}",
        "/v1/sessions/{session_id}/execute",
        "/v1/sessions/{session_id}/completions",
        "/v1/sessions/{session_id}/interrupt",
        "/v1/sessions/{session_id}/files",
        "/v1/sessions/{session_id}/files/{path}",
        "/health",
        "/metrics",
    ):
        assert path in paths, path
    docs = http.get("/docs")
    assert docs.status_code == 200
    assert "swagger" in docs.text.lower()


def test_connections_are_not_held_by_nagle(guarded):
    """Each accepted connection has TCP_NODELAY: uvicorn writes headers and body apart, and
    without it the body of every kept-alive request waits ~40 ms for a delayed ACK."""
    import socket

    with client_of(guarded) as client:
        assert client.get("/health").status_code == 200
        connections = guarded.server.http.server.server_state.connections
        assert connections, "uvicorn should hold the client's kept-alive connection"
        for connection in connections:
            sock = connection.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_http_is_parsed_by_httptools(small):
    """uvicorn's C parser, for ~25% less server CPU per request than h11 (BENCHMARKS.md);
    uvicorn would fall back to h11 silently if it were missing."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert small.server.http is not None
    assert small.server.http.server.config.http_protocol_class is HttpToolsProtocol
    with client_of(small) as http:
        assert http.get("/health").status_code == 200


def _peak_rss_bytes() -> int:
    """This process's peak resident memory since the last `_reset_peak_rss`."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak starts again from now


def test_a_large_file_crosses_both_ways_in_pieces_and_memory_stays_flat(http, session):
    """96 MiB up (a chunked body) and down (read as it comes): the server (in this process,
    and on a cluster its front end too) holds pieces, never the file (whole, it would grow
    the peak by the file and more: base64 on a cluster's data path)."""
    mib = 1 << 20
    pieces = 96
    expected = hashlib.sha256()
    for index in range(pieces):
        expected.update(bytes([index % 251]) * mib)

    def body() -> Iterator[bytes]:
        for index in range(pieces):
            yield bytes([index % 251]) * mib

    _reset_peak_rss()
    before = _peak_rss_bytes()
    put = http.put(f"/v1/sessions/{session}/files/big.bin", content=body(), timeout=300)
    assert put.status_code == 204, put.text
    digest, got = hashlib.sha256(), 0
    with http.stream("GET", f"/v1/sessions/{session}/files/big.bin", timeout=300) as response:
        assert response.status_code == 200
        assert response.headers["content-length"] == str(pieces * mib)
        for chunk in response.iter_bytes():
            digest.update(chunk)
            got += len(chunk)
    assert got == pieces * mib and digest.hexdigest() == expected.hexdigest()
    grown = _peak_rss_bytes() - before
    assert grown < 64 * mib, f"the peak grew {grown / mib:.0f} MiB for a {pieces} MiB file"
    missing = http.get(f"/v1/sessions/{session}/files/nothing.bin")
    assert missing.status_code == 404 and "no such file" in missing.text
