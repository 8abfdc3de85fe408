"""input() and getpass() in a cell, answered by whoever drives the session: over the sessions
API (an SSE `input_request`, then POST .../input), from the SDK's on_input; a clear error
where no client answers (a plain execute, TCP); the cell's timeout and interrupts still apply
while it waits. Against a real gVisor server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cloche.client.sync import Client
from cloche.config import Limits
from support import ServerThread, make_config, require_gvisor, sse_events


@pytest.fixture(scope="module")
def server(state_root) -> Iterator[ServerThread]:
    require_gvisor()
    config = make_config(
        state_root, pool_size=2, limits=Limits(cell_timeout_s=20.0, interrupt_grace_s=2.0)
    )
    with ServerThread(config) as running:
        yield running


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as client:
        yield client


def new_session(http: httpx.Client) -> str:
    made = http.post("/v1/sessions", json={})
    assert made.status_code == 201, made.text
    session_id: str = made.json()["id"]
    return session_id


def streamed(
    http: httpx.Client, session_id: str, body: dict[str, Any], on_request: Any
) -> list[tuple[str, Any]]:
    """The SSE events of a streamed execute; on_request(data) runs at each input_request."""
    events: list[tuple[str, Any]] = []
    with http.stream(
        "POST",
        f"/v1/sessions/{session_id}/execute",
        json=body,
        headers={"Accept": "text/event-stream"},
    ) as response:
        assert response.status_code == 200
        for event, data in sse_events(response):
            events.append((event, data))
            if event == "input_request":
                on_request(data)
    return events


def test_input_is_asked_over_sse_and_answered_by_post(http: httpx.Client) -> None:
    session = new_session(http)
    code = "name = input('your name? ')\nprint('hello', name)\nsecret = __import__('getpass').getpass()\nlen(secret)"  # noqa: E501
    answers = iter(["Ada", "s3cret!"])

    def answer(data: dict[str, Any]) -> None:
        reply = http.post(f"/v1/sessions/{session}/input", json={"value": next(answers)})
        assert reply.status_code == 200 and reply.json() == {"answered": True}, reply.text

    events = streamed(http, session, {"code": code, "allow_stdin": True}, answer)
    asked = [data for kind, data in events if kind == "input_request"]
    assert asked == [
        {"prompt": "your name? ", "password": False},
        {"prompt": "Password: ", "password": True},
    ]
    done = events[-1][1]
    assert done["status"] == "ok", done
    assert done["stdout"] == "hello Ada\n"  # the prompt is the client's to show, not stdout
    assert done["result"] == {"text/plain": "7"}
    # The session keeps what it was told.
    again = http.post(f"/v1/sessions/{session}/execute", json={"code": "name"}).json()
    assert again["result"] == {"text/plain": "'Ada'"}


def test_without_a_client_that_answers_input_raises_at_once(
    http: httpx.Client, server: ServerThread
) -> None:
    session = new_session(http)
    plain = http.post(f"/v1/sessions/{session}/execute", json={"code": "input('x? ')"}).json()
    assert plain["status"] == "error"
    assert plain["error"]["ename"] == "StdinNotImplementedError"
    assert "does not answer prompts" in plain["error"]["evalue"]
    # A stream that did not ask for stdin is no different.
    events = streamed(http, session, {"code": "input()"}, lambda data: None)
    assert events[-1][1]["error"]["ename"] == "StdinNotImplementedError"
    with server.client() as tcp:  # the REPL protocol has no way to answer
        reply = tcp.run("input('x? ')")
        assert reply["status"] == "error", reply
        assert "StdinNotImplementedError" in str(reply)
        assert tcp.run("'still here'", reply["session_id"])["output"] == "'still here'\n"


def test_an_interrupt_reaches_a_cell_waiting_for_input(http: httpx.Client) -> None:
    session = new_session(http)
    http.post(f"/v1/sessions/{session}/execute", json={"code": "kept = 41"})

    def interrupt(data: dict[str, Any]) -> None:
        stopped = http.post(f"/v1/sessions/{session}/interrupt")
        assert stopped.json() == {"interrupted": True}

    events = streamed(http, session, {"code": "input('wait? ')", "allow_stdin": True}, interrupt)
    done = events[-1][1]
    assert done["status"] == "interrupted", done
    assert done["error"]["ename"] == "KeyboardInterrupt"
    assert done["session_alive"] is True
    # Nothing waits now: an answer is refused, and the session goes on with its state.
    late = http.post(f"/v1/sessions/{session}/input", json={"value": "too late"})
    assert late.status_code == 409, late.text
    after = http.post(f"/v1/sessions/{session}/execute", json={"code": "kept + 1"}).json()
    assert after["result"] == {"text/plain": "42"}


def test_the_cell_timeout_runs_while_input_waits(http: httpx.Client) -> None:
    session = new_session(http)
    events = streamed(
        http, session, {"code": "input()", "allow_stdin": True, "timeout": 1.5}, lambda d: None
    )
    done = events[-1][1]
    assert done["status"] == "timeout", done
    assert done["session_alive"] is True


def test_the_sdk_answers_input_from_its_callback(server: ServerThread) -> None:
    asked: list[tuple[str, bool]] = []

    def on_input(prompt: str, password: bool) -> str:
        asked.append((prompt, password))
        return "21"

    with Client(f"http://127.0.0.1:{server.http_port}") as client:
        session = client.create_session()
        try:
            execution = session.run("int(input('half? ')) * 2", on_input=on_input)
            assert execution.error is None, execution.error
            assert execution.result is not None and execution.result.text == "42"
            assert asked == [("half? ", False)]
            refused = session.run("input()")  # no on_input: the cell is told, at once
            assert refused.error is not None
            assert refused.error.ename == "StdinNotImplementedError"
        finally:
            session.close()
