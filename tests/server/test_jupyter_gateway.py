"""The Jupyter kernel gateway (/api) end to end, against a real gVisor server: REST with
httpx, the channels with websockets' client, as a gateway client would drive them."""

from __future__ import annotations

import datetime
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from support import ServerThread, make_config, require_gvisor

MAX_FRAME_BYTES = 256 * 1024
T1 = {"Authorization": "token t1"}
T2 = {"Authorization": "bearer t2"}
BEARER_T1 = {"Authorization": "Bearer t1"}  # the sessions API's way
MODEL_KEYS = {"id", "name", "last_activity", "execution_state", "connections"}
LAST_ACTIVITY = "%Y-%m-%dT%H:%M:%S.%fZ"  # as jupyter_server's gateway client parses it
RECV_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def gateway(state_root) -> Iterator[ServerThread]:
    """A server with two tokens, t1 and t2, and small frames."""
    require_gvisor()
    config = make_config(
        state_root, tokens=frozenset({"t1", "t2"}), pool_size=2, max_frame_bytes=MAX_FRAME_BYTES
    )
    with ServerThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def http(gateway) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=f"http://127.0.0.1:{gateway.http_port}", headers=T1, timeout=60
    ) as client:
        yield client


@pytest.fixture
def kernel(http) -> Iterator[str]:
    """A fresh kernel of t1, shut down afterwards."""
    response = http.post("/api/kernels")
    assert response.status_code == 201, response.text
    kernel_id: str = response.json()["id"]
    yield kernel_id
    http.delete(f"/api/kernels/{kernel_id}")


class Channels:
    """One websocket to a kernel's channels, in Jupyter's legacy JSON framing."""

    def __init__(self, server: ServerThread, kernel_id: str, token: str = "t1", **extra: Any):  # noqa: S107
        url = f"ws://127.0.0.1:{server.http_port}/api/kernels/{kernel_id}/channels"
        if token:
            url += f"?token={token}"
        # (entered here: websockets wants its connections used as context managers)
        self.ws: ClientConnection = connect(url, proxy=None, open_timeout=30, **extra).__enter__()
        self.session = uuid.uuid4().hex

    def __enter__(self) -> Channels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ws.close()

    def send(self, msg_type: str, content: dict[str, Any] | None = None, **fields: Any) -> str:
        msg_id = uuid.uuid4().hex
        header = {
            "msg_id": msg_id,
            "msg_type": msg_type,
            "session": self.session,
            "username": "tester",
            "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "version": "5.3",
        }
        message = {
            "header": header,
            "parent_header": {},
            "metadata": {},
            "content": content or {},
            "buffers": [],
            "channel": "shell",
            **fields,
        }
        self.ws.send(json.dumps(message))
        return msg_id

    def execute(self, code: str, **content: Any) -> str:
        return self.send("execute_request", {"code": code, "silent": False, **content})

    def recv(self) -> dict[str, Any]:
        message: dict[str, Any] = json.loads(self.ws.recv(timeout=RECV_TIMEOUT_S))
        return message

    def until_idle(
        self, msg_id: str, reply: bool = True, seen: Callable[[dict[str, Any]], None] | None = None
    ) -> list[dict[str, Any]]:
        """The messages whose parent is msg_id, up to its iopub idle (and its reply)."""
        found: list[dict[str, Any]] = []
        while True:
            message = self.recv()
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            found.append(message)
            if seen is not None:
                seen(message)
            idle = any(_is_status(m, "idle") for m in found)
            replied = any(m["msg_type"].endswith("_reply") for m in found)
            if idle and (replied or not reply):
                return found

    def reply_to(self, msg_id: str) -> dict[str, Any]:
        """The reply to msg_id (a control request's: it has no busy/idle)."""
        while True:
            message = self.recv()
            if message["parent_header"].get("msg_id") == msg_id and message["msg_type"].endswith(
                "_reply"
            ):
                return message

    def until_started(self, msg_id: str) -> None:
        """Read until the cell msg_id printed 'started'."""
        while True:
            message = self.recv()
            if (
                message["parent_header"].get("msg_id") == msg_id
                and message["msg_type"] == "stream"
                and "started" in message["content"]["text"]
            ):
                return

    def run(self, code: str, **content: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Execute code: (its iopub messages, its reply)."""
        found = self.until_idle(self.execute(code, **content))
        return [m for m in found if m["channel"] == "iopub"], _reply_of(found)


def _is_status(message: dict[str, Any], state: str) -> bool:
    return message["msg_type"] == "status" and message["content"]["execution_state"] == state


def _reply_of(found: list[dict[str, Any]]) -> dict[str, Any]:
    (reply,) = [m for m in found if m["msg_type"].endswith("_reply")]
    return reply


def _types(messages: list[dict[str, Any]]) -> list[str]:
    return [m["msg_type"] for m in messages]


def _stdout(messages: list[dict[str, Any]]) -> str:
    return "".join(
        m["content"]["text"]
        for m in messages
        if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
    )


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


# --- REST ------------------------------------------------------------------------------


def test_api_version_and_kernelspecs(http):
    assert set(http.get("/api").json()) == {"version"}
    specs = http.get("/api/kernelspecs").json()
    assert specs["default"] == "python3"
    assert {"python3", "cloche-lean", "cloche-data"} <= set(specs["kernelspecs"])
    python3 = http.get("/api/kernelspecs/python3").json()
    assert python3 == specs["kernelspecs"]["python3"]
    assert python3["name"] == "python3"
    assert python3["spec"]["language"] == "python"
    assert python3["spec"]["interrupt_mode"] == "message"
    assert {"argv", "display_name", "metadata"} <= set(python3["spec"])
    assert http.get("/api/kernelspecs/nope").status_code == 404
    assert http.get("/api/kernelspecs", headers={"Authorization": ""}).status_code == 401


def test_a_kernel_is_a_session_both_ways(http):
    response = http.post("/api/kernels", json={"name": "python3", "path": "nb.ipynb"})
    assert response.status_code == 201, response.text
    model = response.json()
    kernel_id = model["id"]
    assert set(model) == MODEL_KEYS
    assert model["name"] == "python3"
    assert model["execution_state"] == "idle"
    assert model["connections"] == 0
    datetime.datetime.strptime(model["last_activity"], LAST_ACTIVITY)
    made = http.post("/v1/sessions", headers=BEARER_T1)
    assert made.status_code == 201
    session_id = made.json()["id"]
    try:
        kernels = {k["id"] for k in http.get("/api/kernels").json()}
        sessions = {s["id"] for s in http.get("/v1/sessions", headers=BEARER_T1).json()["sessions"]}
        assert {kernel_id, session_id} <= kernels
        assert {kernel_id, session_id} <= sessions
        assert http.get(f"/api/kernels/{session_id}").json()["id"] == session_id
        assert http.get(f"/api/kernels/{kernel_id}").json() == {**model, "last_activity": ANY}
    finally:
        assert http.delete(f"/api/kernels/{session_id}").status_code == 204
    assert http.delete(f"/api/kernels/{kernel_id}").status_code == 204
    assert http.get(f"/api/kernels/{kernel_id}").status_code == 404
    assert http.delete(f"/api/kernels/{kernel_id}").status_code == 404
    assert http.get(f"/v1/sessions/{session_id}", headers=BEARER_T1).status_code == 404


class _Any:
    def __eq__(self, other: object) -> bool:
        return True


ANY = _Any()


def test_unknown_kernels_and_specs(http):
    unknown = "0" * 32
    for response in (
        http.get(f"/api/kernels/{unknown}"),
        http.delete(f"/api/kernels/{unknown}"),
        http.post(f"/api/kernels/{unknown}/interrupt"),
    ):
        assert response.status_code == 404, response.request
    assert http.post("/api/kernels", json={"name": "ruby"}).status_code == 400


def test_tokens_guard_kernels(gateway, http, kernel):
    base = f"http://127.0.0.1:{gateway.http_port}"
    with httpx.Client(base_url=base, timeout=60) as anonymous:
        for response in (
            anonymous.get("/api/kernels"),
            anonymous.post("/api/kernels"),
            anonymous.get(f"/api/kernels/{kernel}"),
            anonymous.delete(f"/api/kernels/{kernel}"),
            anonymous.get(f"/api/kernels/{kernel}", headers={"Authorization": "token t3"}),
            anonymous.get(f"/api/kernels/{kernel}", headers={"Authorization": "basic t1"}),
        ):
            assert response.status_code == 401, response.request
        assert anonymous.get(f"/api/kernels/{kernel}?token=t1").json()["id"] == kernel
        assert anonymous.get(f"/api/kernels/{kernel}", headers=T1).status_code == 200
        for response in (
            anonymous.get(f"/api/kernels/{kernel}", headers=T2),
            anonymous.get(f"/api/kernels/{kernel}?token=t2"),
            anonymous.delete(f"/api/kernels/{kernel}", headers=T2),
            anonymous.post(f"/api/kernels/{kernel}/interrupt", headers=T2),
        ):
            assert response.status_code == 404, response.request
        assert kernel not in {k["id"] for k in anonymous.get("/api/kernels", headers=T2).json()}
    for token, status in (("", 401), ("t3", 401), ("t2", 404)):
        with pytest.raises(InvalidStatus) as refused:
            Channels(gateway, kernel, token=token)
        assert refused.value.response.status_code == status
    with Channels(gateway, kernel, token="", additional_headers=T1) as channels:
        assert _reply_of(channels.until_idle(channels.send("kernel_info_request")))
    assert http.get(f"/api/kernels/{kernel}").status_code == 200  # still there for t1


def test_env_entries_become_the_kernels_environment(gateway, http):
    env = {"GREETING": "hello", "KERNEL_WORKING_DIR": "/home/someone/notebooks"}
    response = http.post("/api/kernels", json={"env": env})
    assert response.status_code == 201, response.text
    kernel_id = response.json()["id"]
    try:
        with Channels(gateway, kernel_id) as channels:
            iopub, reply = channels.run(
                "import os\nos.environ.get('GREETING'), 'KERNEL_WORKING_DIR' in os.environ"
            )
        assert reply["content"]["status"] == "ok"
        (result,) = [m for m in iopub if m["msg_type"] == "execute_result"]
        assert result["content"]["data"]["text/plain"] == "('hello', False)"
        assert result["content"]["execution_count"] == 1  # the setup was not counted
    finally:
        http.delete(f"/api/kernels/{kernel_id}")


# --- the channels ------------------------------------------------------------------------


def test_kernel_info_is_wrapped_in_busy_and_idle(gateway, kernel):
    with Channels(gateway, kernel, subprotocols=["v1.kernel.websocket.jupyter.org"]) as channels:
        assert channels.ws.subprotocol is None  # declined: the legacy JSON framing it is
        msg_id = channels.send("kernel_info_request")
        found = channels.until_idle(msg_id)
        again = channels.until_idle(channels.send("kernel_info_request"))
    assert _types(found) == ["status", "kernel_info_reply", "status"]
    assert [m["channel"] for m in found] == ["iopub", "shell", "iopub"]
    assert _is_status(found[0], "busy") and _is_status(found[2], "idle")
    reply = found[1]["content"]
    assert reply["status"] == "ok"
    assert reply["protocol_version"] == "5.3"
    assert reply["implementation"] == "cloche"
    assert reply["debugger"] is False
    assert reply["help_links"] == []
    assert reply["language_info"]["name"] == "python"
    assert reply["language_info"]["codemirror_mode"] == {"name": "ipython", "version": 3}
    ids = set()
    for message in found + again:
        header = message["header"]
        assert message["parent_header"]["msg_id"] in (msg_id, again[0]["parent_header"]["msg_id"])
        assert message["msg_id"] == header["msg_id"]
        assert message["msg_type"] == header["msg_type"]
        assert header["version"] == "5.3"
        assert header["username"] == "tester"
        assert header["session"] == found[0]["header"]["session"]  # stable per kernel
        assert isinstance(header["date"], str) and header["date"].startswith("20")
        assert message["buffers"] == []
        ids.add(header["msg_id"])
    assert len(ids) == len(found + again)  # every message has its own id


def test_liberal_messages_are_accepted(gateway, kernel):
    with Channels(gateway, kernel) as channels:
        for extra in (
            {"channel": None, "buffers": {}},
            {"buffers": None},
        ):
            message = {
                "header": {"msg_id": uuid.uuid4().hex, "msg_type": "kernel_info_request"},
                "parent_header": {},
                "content": {},
                **extra,
            }
            if extra.get("channel", "") is None:
                del message["channel"]
                message["header"].update(date=time.time(), version="5.0")
            channels.ws.send(json.dumps(message))
            found = channels.until_idle(message["header"]["msg_id"])
            assert _reply_of(found)["channel"] == "shell"


def test_execute_streams_output_then_result_and_reply(gateway, kernel):
    with Channels(gateway, kernel) as channels:
        code = "print('a'); import time; time.sleep(0.5); print('b'); 6*7"
        iopub, reply = channels.run(code)
        _, second = channels.run("'again'")
    types = _types(iopub)
    assert types[0] == "status" and _is_status(iopub[0], "busy")
    assert types[1] == "execute_input"
    assert iopub[1]["content"] == {"code": code, "execution_count": 1}
    assert _stdout(iopub) == "a\nb\n"
    assert types.index("stream") < types.index("execute_result")
    (result,) = [m for m in iopub if m["msg_type"] == "execute_result"]
    assert result["content"]["data"]["text/plain"] == "42"
    assert result["content"]["execution_count"] == 1
    assert _is_status(iopub[-1], "idle")
    assert reply["channel"] == "shell"
    assert reply["content"] == {
        "status": "ok",
        "execution_count": 1,
        "user_expressions": {},
        "payload": [],
    }
    assert second["content"]["execution_count"] == 2


def test_output_arrives_while_the_cell_runs(gateway, http, kernel):
    """The cell waits for a file the test writes only after it saw the first output."""
    code = (
        "import os, time\nprint('first', flush=True)\n"
        "while not os.path.exists('go'):\n    time.sleep(0.01)\n"
        "print('second')\n"
    )

    def release(message: dict[str, Any]) -> None:
        if message["msg_type"] == "stream" and "first" in message["content"]["text"]:
            put = http.put(
                f"/v1/sessions/{kernel}/files/go",
                content=b"",
                headers=BEARER_T1,
            )
            assert put.status_code == 204

    with Channels(gateway, kernel) as channels:
        found = channels.until_idle(channels.execute(code), seen=release)
    assert _stdout(found) == "first\nsecond\n"
    assert _reply_of(found)["content"]["status"] == "ok"


def test_a_silent_long_cell_is_announced_while_it_runs(gateway, http, kernel):
    """A short cell's first messages are held back to leave with its reply; a cell that runs
    on without output still shows busy and its input while it runs: this one waits for a
    file the test writes only once it saw both."""
    code = "import os, time\nwhile not os.path.exists('go'):\n    time.sleep(0.01)\n"
    announced: list[str] = []

    def release(message: dict[str, Any]) -> None:
        if _is_status(message, "busy") or message["msg_type"] == "execute_input":
            announced.append(message["msg_type"])
            if len(announced) == 2:
                put = http.put(f"/v1/sessions/{kernel}/files/go", content=b"", headers=BEARER_T1)
                assert put.status_code == 204

    with Channels(gateway, kernel) as channels:
        found = channels.until_idle(channels.execute(code), seen=release)
    assert announced == ["status", "execute_input"]
    assert _reply_of(found)["content"]["status"] == "ok"


def test_help_goes_to_the_pager_as_ipython_sends_it(gateway, kernel):
    """`obj?` over Jupyter is a `page` payload in execute_reply, not output (TCP prints it:
    test_ipython_cells)."""
    with Channels(gateway, kernel) as channels:
        channels.run('def area(w, h):\n    "The area of a w by h rectangle."\n    return w * h')
        iopub, reply = channels.run("area?")
        deep_iopub, deep_reply = channels.run("area??")
    assert "stream" not in _types(iopub) and "stream" not in _types(deep_iopub)
    (page,) = reply["content"]["payload"]
    assert page["source"] == "page" and page["start"] == 0
    assert "area(w, h)" in page["data"]["text/plain"]
    assert "The area of a w by h rectangle." in page["data"]["text/plain"]
    (deep,) = deep_reply["content"]["payload"]
    assert "return w * h" in deep["data"]["text/plain"]


def test_an_error_cell_ends_in_error(gateway, kernel):
    with Channels(gateway, kernel) as channels:
        iopub, reply = channels.run("def f():\n    raise ValueError('nope')\nf()")
        _, after = channels.run("1")
    (error,) = [m for m in iopub if m["msg_type"] == "error"]
    assert error["content"]["ename"] == "ValueError"
    assert error["content"]["evalue"] == "nope"
    assert any("ValueError" in line for line in error["content"]["traceback"])
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "ValueError"
    assert after["content"]["status"] == "ok"  # a request after the error runs


def test_stop_on_error_aborts_the_requests_queued_behind(gateway, http, kernel):
    failing = "import os, time\nwhile not os.path.exists('go'):\n    time.sleep(0.01)\n1/0"
    with Channels(gateway, kernel) as channels:
        first = channels.execute(failing)
        queued = channels.execute("x = 'ran'")
        # Control is answered at once and frames are read in order: once this reply is in,
        # the second request waits in the queue.
        ack = channels.send("kernel_info_request", channel="control")
        assert channels.reply_to(ack)["channel"] == "control"
        put = http.put(f"/v1/sessions/{kernel}/files/go", content=b"", headers=BEARER_T1)
        assert put.status_code == 204
        failed = _reply_of(channels.until_idle(first))
        aborted = _reply_of(channels.until_idle(queued))
        iopub, check = channels.run("'x' in globals()")
    assert failed["content"]["status"] == "error"
    assert failed["content"]["ename"] == "ZeroDivisionError"
    assert aborted["msg_type"] == "execute_reply"
    assert aborted["content"]["status"] == "aborted"
    assert check["content"]["status"] == "ok"
    (result,) = [m for m in iopub if m["msg_type"] == "execute_result"]
    assert result["content"]["data"]["text/plain"] == "False"


SLEEPER = "import time\nprint('started', flush=True)\ntime.sleep(30)"


def _interrupted(channels: Channels, msg_id: str) -> None:
    found = channels.until_idle(msg_id)
    (error,) = [m for m in found if m["msg_type"] == "error"]
    assert error["content"]["ename"] == "KeyboardInterrupt"
    reply = _reply_of(found)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"


def test_rest_interrupt_stops_the_cell_and_keeps_the_state(gateway, http, kernel):
    with Channels(gateway, kernel) as channels:
        channels.run("kept = 'yes'")
        msg_id = channels.execute(SLEEPER)
        channels.until_started(msg_id)
        assert http.get(f"/api/kernels/{kernel}").json()["execution_state"] == "busy"
        assert http.post(f"/api/kernels/{kernel}/interrupt").status_code == 204
        _interrupted(channels, msg_id)
        iopub, _ = channels.run("kept")
    (result,) = [m for m in iopub if m["msg_type"] == "execute_result"]
    assert result["content"]["data"]["text/plain"] == "'yes'"


def test_control_interrupt_stops_the_cell_and_keeps_the_state(gateway, kernel):
    with Channels(gateway, kernel) as channels:
        channels.run("kept = 'yes'")
        msg_id = channels.execute(SLEEPER)
        channels.until_started(msg_id)
        interrupt = channels.send("interrupt_request", channel="control")
        assert channels.reply_to(interrupt)["content"]["status"] == "ok"
        _interrupted(channels, msg_id)
        iopub, _ = channels.run("kept")
    (result,) = [m for m in iopub if m["msg_type"] == "execute_result"]
    assert result["content"]["data"]["text/plain"] == "'yes'"


def test_every_connection_of_a_kernel_sees_iopub(gateway, kernel):
    with Channels(gateway, kernel) as asker, Channels(gateway, kernel) as watcher:
        # Both are attached once each has had an answer.
        for channels in (asker, watcher):
            channels.until_idle(channels.send("kernel_info_request"))
        msg_id = asker.execute("print('hi')")
        asked = asker.until_idle(msg_id)
        watched = watcher.until_idle(msg_id, reply=False)
    assert _stdout(asked) == _stdout(watched) == "hi\n"
    assert "execute_reply" in _types(asked)
    assert "execute_reply" not in _types(watched)  # replies go to the connection that asked
    assert _is_status(watched[0], "busy") and _is_status(watched[-1], "idle")


def test_a_connection_closed_mid_cell_lets_the_cell_finish(gateway, http, kernel):
    code = (
        "import os, time\nprint('started', flush=True)\n"
        "while not os.path.exists('go'):\n    time.sleep(0.01)\nx = 7"
    )
    with Channels(gateway, kernel) as channels:
        channels.until_started(channels.execute(code))
    put = http.put(f"/v1/sessions/{kernel}/files/go", content=b"", headers=BEARER_T1)
    assert put.status_code == 204
    with Channels(gateway, kernel) as channels:
        # Shell requests take turns: this one is answered after the cell.
        channels.until_idle(channels.send("kernel_info_request"))
        assert http.get(f"/api/kernels/{kernel}").json()["execution_state"] == "idle"
        iopub, reply = channels.run("x")
    (result,) = [m for m in iopub if m["msg_type"] == "execute_result"]
    assert result["content"]["data"]["text/plain"] == "7"
    assert reply["content"]["execution_count"] == 2


def test_a_frame_that_is_not_json_closes_only_that_connection(gateway, http, kernel):
    with Channels(gateway, kernel) as channels:
        channels.ws.send("this is not json")
        with pytest.raises(ConnectionClosed) as closed:
            channels.recv()
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1003
    assert closed.value.rcvd.reason
    with Channels(gateway, kernel) as channels:
        _, reply = channels.run("1 + 1")
    assert reply["content"]["status"] == "ok"


def test_a_frame_over_the_limit_closes_with_1009(gateway, kernel):
    with Channels(gateway, kernel) as channels:
        channels.ws.send("x" * (MAX_FRAME_BYTES + 1))
        with pytest.raises(ConnectionClosed) as closed:
            channels.recv()
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1009
    assert closed.value.rcvd.reason
    with Channels(gateway, kernel) as channels:
        _, reply = channels.run("1 + 1")
    assert reply["content"]["status"] == "ok"


def test_an_unknown_message_type_is_not_answered(gateway, kernel):
    with Channels(gateway, kernel) as channels:
        unknown = channels.send("frobnicate_request")
        known = channels.send("kernel_info_request")
        # Shell requests are answered in order: anything for the first would come first.
        first = channels.recv()
        found = channels.until_idle(known)
    assert first["parent_header"]["msg_id"] == known
    assert all(m["parent_header"]["msg_id"] != unknown for m in found)


def test_is_complete_and_comm_info(gateway, kernel):
    cases = {
        "x = 1": {"status": "complete"},
        "for i in range(3):": {"status": "incomplete", "indent": "    "},
        "x = (1,": {"status": "incomplete", "indent": ""},
        "x = = 1": {"status": "invalid"},
        "!ls -l": {"status": "complete"},
        "%%bash\necho hi": {"status": "complete"},
    }
    with Channels(gateway, kernel) as channels:
        for code, expected in cases.items():
            asked = channels.send("is_complete_request", {"code": code})
            reply = _reply_of(channels.until_idle(asked))
            assert reply["content"] == expected, code
        comms = _reply_of(channels.until_idle(channels.send("comm_info_request")))
    assert comms["content"] == {"status": "ok", "comms": {}}


def test_restart_over_control_and_rest_gives_a_fresh_interpreter_same_id(gateway, http, kernel):
    with Channels(gateway, kernel) as channels:
        first = channels.until_idle(channels.execute("x = 1"))
        session_before = first[0]["header"]["session"]
        restart = channels.send("shutdown_request", {"restart": True}, channel="control")
        reply = channels.reply_to(restart)
        assert reply["content"] == {"status": "ok", "restart": True}
        after = channels.until_idle(channels.execute("x"))
        assert _reply_of(after)["content"]["ename"] == "NameError"
        assert _reply_of(after)["content"]["execution_count"] == 1
        assert {m["header"]["session"] for m in after} != {session_before}
    restarted = http.post(f"/api/kernels/{kernel}/restart")
    assert restarted.status_code == 200, restarted.text
    assert restarted.json()["id"] == kernel and set(restarted.json()) == MODEL_KEYS
    assert http.post("/api/kernels/not-a-kernel/restart").status_code == 404


def test_complete_inspect_and_history_come_from_the_live_session(gateway, kernel):
    with Channels(gateway, kernel) as channels:
        channels.until_idle(channels.execute("import json\nvalue_one = 1\nvalue_two = 2"))
        asked = channels.send("complete_request", {"code": "value_", "cursor_pos": 6})
        found = _reply_of(channels.until_idle(asked))["content"]
        assert found["status"] == "ok"
        assert found["matches"] == ["value_one", "value_two"]
        assert (found["cursor_start"], found["cursor_end"]) == (0, 6)
        asked = channels.send("inspect_request", {"code": "json.dumps", "cursor_pos": 10})
        helped = _reply_of(channels.until_idle(asked))["content"]
        assert helped["status"] == "ok" and helped["found"] is True
        assert "Serialize" in helped["data"]["text/plain"]
        asked = channels.send("inspect_request", {"code": "nothing_here", "cursor_pos": 3})
        assert _reply_of(channels.until_idle(asked))["content"]["found"] is False
        asked = channels.send(
            "history_request", {"hist_access_type": "tail", "n": 10, "output": False, "raw": True}
        )
        history = _reply_of(channels.until_idle(asked))["content"]["history"]
        assert history == [[0, 1, "import json\nvalue_one = 1\nvalue_two = 2"]]
        # The asks were not counted as cells.
        counted = _reply_of(channels.until_idle(channels.execute("1")))["content"]
        assert counted["execution_count"] == 2


def test_input_is_asked_on_stdin_when_the_client_allows_it(gateway, kernel):
    with Channels(gateway, kernel) as channels:
        asked = channels.execute("name = input('who? ')\nname.upper()", allow_stdin=True)
        while True:
            message = channels.recv()
            if message["msg_type"] == "input_request":
                break
        assert message["channel"] == "stdin"
        assert message["parent_header"]["msg_id"] == asked
        assert message["content"] == {"prompt": "who? ", "password": False}
        channels.send("input_reply", {"value": "ada"}, channel="stdin")
        found = channels.until_idle(asked)
        results = [m for m in found if m["msg_type"] == "execute_result"]
        assert results[0]["content"]["data"]["text/plain"] == "'ADA'"
        # Without allow_stdin, input() says so at once.
        refused = _reply_of(channels.until_idle(channels.execute("input()")))["content"]
        assert refused["ename"] == "StdinNotImplementedError"
        # An interrupt reaches a cell waiting for its input.
        waiting = channels.execute("input('never? ')", allow_stdin=True)
        while channels.recv()["msg_type"] != "input_request":
            pass
        channels.send("interrupt_request", channel="control")
        stopped = _reply_of(channels.until_idle(waiting))["content"]
        assert stopped["status"] == "error" and stopped["ename"] == "KeyboardInterrupt"


def test_shutdown_over_control(gateway, http, kernel):
    with Channels(gateway, kernel) as channels:
        stop = channels.send("shutdown_request", {"restart": False}, channel="control")
        reply = channels.reply_to(stop)
        assert reply["msg_type"] == "shutdown_reply"
        assert reply["channel"] == "control"
        assert reply["parent_header"]["msg_id"] == stop
        assert reply["content"] == {"status": "ok", "restart": False}
    assert http.get(f"/api/kernels/{kernel}").status_code == 404


def test_connections_are_counted_and_leak_nothing(gateway, http, kernel):
    app = gateway.server.http.app  # type: ignore[union-attr]
    gateway.call(gateway.server.manager.wait_ready("lean"), timeout_s=600)
    with Channels(gateway, kernel) as channels:
        channels.until_idle(channels.send("kernel_info_request"))
        assert http.get(f"/api/kernels/{kernel}").json()["connections"] == 1
        assert metric(http, "cloche_jupyter_connections") == 1
    wait_for(lambda: not app.state.jupyter.kernels, "the kernel to be released")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(1000):
        Channels(gateway, kernel).ws.close()
    wait_for(
        lambda: not app.state.jupyter.kernels and len(os.listdir("/proc/self/fd")) <= before + 3,
        "the connections' descriptors to be closed",
    )
    assert metric(http, "cloche_jupyter_connections") == 0
    assert http.get(f"/api/kernels/{kernel}").json()["connections"] == 0
    assert metric(http, "cloche_jupyter_requests_total", route="/api/kernels/{kernel_id}") > 0


def test_a_paused_kernel_resumes_on_a_websocket_message(gateway, http, kernel):
    with Channels(gateway, kernel) as channels:
        channels.until_idle(channels.execute("kept = 'before the pause'"))
    paused = http.post(f"/v1/sessions/{kernel}/pause", headers=BEARER_T1)
    assert paused.status_code == 200, paused.text
    assert paused.json()["state"] == "paused"
    assert http.get(f"/api/kernels/{kernel}").json()["execution_state"] == "idle"
    with Channels(gateway, kernel) as channels:
        iopub, reply = channels.run("kept")
    assert reply["content"]["status"] == "ok"
    (result,) = [m for m in iopub if m["msg_type"] == "execute_result"]
    assert result["content"]["data"]["text/plain"] == "'before the pause'"
    assert http.get(f"/v1/sessions/{kernel}", headers=BEARER_T1).json()["state"] == "idle"


def test_a_restart_during_a_running_cell_stops_it_and_the_kernel_goes_on(gateway, http, kernel):
    code = "import time\nprint('started', flush=True)\nkept = 1\ntime.sleep(60)"
    with Channels(gateway, kernel) as channels:
        running = channels.execute(code)
        channels.until_started(running)
        restarted = http.post(f"/api/kernels/{kernel}/restart")
        assert restarted.status_code == 200, restarted.text
        ended = _reply_of(channels.until_idle(running))["content"]
        assert ended["status"] == "error" and ended["ename"] == "KeyboardInterrupt"
        after = _reply_of(channels.until_idle(channels.execute("'kept' in dir()")))
    assert after["content"]["status"] == "ok"


def test_websocket_sse_and_tcp_drive_one_namespace(gateway, http, kernel):
    with Channels(gateway, kernel) as channels:
        channels.until_idle(channels.execute("shared = ['websocket']"))
    streamed = http.post(
        f"/v1/sessions/{kernel}/execute?stream=true",
        json={"code": "shared.append('sse'); len(shared)"},
        headers=BEARER_T1,
    )
    assert streamed.status_code == 200
    assert 'event: result\ndata: {"text/plain":"2"}' in streamed.text
    with gateway.client() as tcp:
        reply = tcp.run("shared.append('tcp'); shared", kernel, token="t1")
    assert reply["output"] == "['websocket', 'sse', 'tcp']\n", reply
    with Channels(gateway, kernel) as channels:
        iopub, _ = channels.run("len(shared)")
    (result,) = [m for m in iopub if m["msg_type"] == "execute_result"]
    assert result["content"]["data"]["text/plain"] == "3"
