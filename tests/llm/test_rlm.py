"""The RLM loop behind POST /v1/chat/completions, with the stub as root and sub-model."""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from llm.stub import StubError, StubLLM
from support import ServerThread

NEEDLE = "7261359"
CHUNKING = """I will read the context in pieces.
```repl
size = 500_000
answers = []
for start in range(0, len(context), size):
    answers.append(llm_query(
        "Find the magic number in this text; answer with the number, or none.\\n"
        + context[start:start + size]))
found = [a for a in answers if a != "none"]
answer = found[0] if found else "not found"
print(len(answers), found)
```"""
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


def haystack(size_chars: int, seed: int = 7) -> str:
    """Random lines, with the needle's line somewhere past the middle."""
    rng = random.Random(seed)
    lines: list[str] = []
    total = 0
    while total < size_chars:
        line = " ".join(rng.choices(WORDS, k=12))
        lines.append(line)
        total += len(line) + 1
    lines.insert(len(lines) * 5 // 8, f"The magic number is {NEEDLE}.")
    return "\n".join(lines)


def script(body: dict[str, Any]) -> str:
    """Root: chunk the context with llm_query, then FINAL_VAR. Sub: find the needle."""
    messages = body["messages"]
    if messages[0]["role"] == "system":
        turns = sum(1 for m in messages if m["role"] == "assistant")
        return CHUNKING if turns == 0 else "The answer is in a variable.\nFINAL_VAR(answer)"
    found = re.search(r"magic number is (\d+)", messages[-1]["content"])
    return found[1] if found else "none"


@pytest.fixture
def http(llm_server: ServerThread) -> Iterator[httpx.Client]:
    base = f"http://127.0.0.1:{llm_server.http_port}"
    with httpx.Client(base_url=base, timeout=120) as client:
        yield client


def ask(http: httpx.Client, body: dict[str, Any], session: str | None = None) -> httpx.Response:
    headers = {"x-cloche-session-id": session} if session else {}
    return http.post("/v1/chat/completions", json=body, headers=headers)


def test_an_rlm_finds_a_needle_in_a_multi_megabyte_context(http, stub: StubLLM):
    stub.reset(script)
    context = haystack(4_000_000)
    answer = ask(
        http,
        {
            "model": "rlm:stub-model",
            "messages": [{"role": "user", "content": "What is the magic number?"}],
            "context": context,
        },
    )
    assert answer.status_code == 200, answer.text
    completion = answer.json()
    assert completion["object"] == "chat.completion"
    assert completion["model"] == "rlm:stub-model"
    assert completion["choices"][0]["message"] == {"role": "assistant", "content": NEEDLE}
    assert completion["choices"][0]["finish_reason"] == "stop"
    roots = [r for r in stub.requests if r.is_root]
    subs = [r for r in stub.requests if not r.is_root]
    assert len(roots) == 2
    assert len(subs) == -(-len(context) // 500_000)
    assert all(r.body["model"] == "stub-model" for r in stub.requests)
    assert f"a str of {len(context)} characters" in roots[0].body["messages"][0]["content"]
    assert f"['{NEEDLE}']" in roots[1].body["messages"][-1]["content"]  # the code's output
    usage = completion["usage"]
    assert usage["prompt_tokens"] == sum(r.usage["prompt_tokens"] for r in stub.requests)
    assert usage["completion_tokens"] == sum(r.usage["completion_tokens"] for r in stub.requests)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    session = answer.headers["x-cloche-session-id"]
    assert http.get(f"/v1/sessions/{session}").status_code == 200
    http.delete(f"/v1/sessions/{session}")


def test_the_openai_client_itself_gets_the_answer_and_keeps_the_repl(
    llm_server: ServerThread, stub: StubLLM
):
    stub.reset(script)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{llm_server.http_port}/v1", api_key="unused", max_retries=0
    )
    context = haystack(2_000_000, seed=11)
    raw = client.chat.completions.with_raw_response.create(
        model="rlm:stub-model",
        messages=[{"role": "user", "content": "What is the magic number?"}],
        extra_body={"context": context},
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == NEEDLE
    assert completion.usage is not None and completion.usage.total_tokens > 0
    session = raw.headers["x-cloche-session-id"]

    # The same session: the REPL still has `context` and `answer` from the first run.
    stub.reset(lambda body: "FINAL_VAR(answer)")
    again = client.chat.completions.with_raw_response.create(
        model="rlm:stub-model",
        messages=[{"role": "user", "content": "And again?"}],
        extra_headers={"x-cloche-session-id": session},
    )
    assert again.parse().choices[0].message.content == NEEDLE
    assert again.headers["x-cloche-session-id"] == session
    (root,) = stub.requests
    assert f"a str of {len(context)} characters" in root.body["messages"][0]["content"]
    client.close()
    httpx.delete(f"http://127.0.0.1:{llm_server.http_port}/v1/sessions/{session}")


def test_the_sub_model_is_the_one_named(http, stub: StubLLM):
    stub.reset(script)
    answer = ask(
        http,
        {"model": "rlm:big-model", "messages": [{"role": "user", "content": "?"}], "context": "x"},
    )
    assert answer.status_code == 200, answer.text
    assert {r.body["model"] for r in stub.requests} == {"big-model"}
    # After the run, the session's own cells get the server's model again.
    session = answer.headers["x-cloche-session-id"]
    stub.reset()
    cell = http.post(f"/v1/sessions/{session}/execute", json={"code": "llm_query('x')"})
    assert cell.json()["result_json"] == "echo: x"
    assert [r.body["model"] for r in stub.requests] == ["stub-model"]
    http.delete(f"/v1/sessions/{session}")


def test_without_a_context_a_new_session_gets_the_message(http, stub: StubLLM):
    stub.reset(lambda body: "FINAL(done)")
    message = "a long document... " * 100 + "What is it about?"
    answer = ask(http, {"model": "rlm:", "messages": [{"role": "user", "content": message}]})
    assert answer.json()["choices"][0]["message"]["content"] == "done"
    (root,) = stub.requests
    assert root.body["model"] == "stub-model"  # rlm: alone is the server's --llm-model
    assert f"a str of {len(message)} characters" in root.body["messages"][0]["content"]


def test_a_run_without_final_is_cut_off_after_the_last_turn(make_llm_server, stub: StubLLM):
    server = make_llm_server(rlm_max_iterations=2)

    def stubborn(body: dict[str, Any]) -> str:
        if "You have used all 2 turns" in body["messages"][-1]["content"]:
            return "FINAL(gave up)"
        return "```repl\nprint('still looking')\n```"

    stub.reset(stubborn)
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as http:
        answer = ask(
            http, {"model": "rlm:m", "messages": [{"role": "user", "content": "?"}], "context": ""}
        )
    choice = answer.json()["choices"][0]
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": "gave up"},
        "finish_reason": "length",
    }
    assert len(stub.requests) == 3
    assert "still looking" in stub.requests[1].body["messages"][-1]["content"]


def test_outputs_are_cut_to_the_configured_size(make_llm_server, stub: StubLLM):
    server = make_llm_server(rlm_output_chars=100)
    replies = iter(["```repl\nprint('y' * 5000)\n```", "FINAL(ok)"])
    stub.reset(lambda body: next(replies))
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as http:
        ask(http, {"model": "rlm:m", "messages": [{"role": "user", "content": "?"}], "context": ""})
    shown = stub.requests[1].body["messages"][-1]["content"]
    assert "y" * 100 in shown and "y" * 101 not in shown
    assert "[... 4900 more characters cut]" in shown


def test_a_final_var_that_does_not_exist_is_reported_to_the_model(http, stub: StubLLM):
    replies = iter(["FINAL_VAR(nowhere)", "FINAL(recovered)"])
    stub.reset(lambda body: next(replies))
    answer = ask(http, {"model": "rlm:m", "messages": [{"role": "user", "content": "?"}]})
    assert answer.json()["choices"][0]["message"]["content"] == "recovered"
    assert "NameError" in stub.requests[1].body["messages"][-1]["content"]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "?"}]}, 400),
        ({"model": "rlm:m", "messages": [{"role": "user", "content": "?"}], "stream": True}, 400),
        ({"model": "rlm:m", "messages": []}, 400),
    ],
    ids=["not an rlm model", "stream", "no messages"],
)
def test_bad_requests_are_refused(http, stub: StubLLM, body: dict[str, Any], status: int):
    answer = ask(http, body)
    assert answer.status_code == status
    assert answer.json()["error"]["type"] == "invalid_request"
    assert stub.requests == []


def test_an_unknown_session_is_not_found(http):
    body = {"model": "rlm:m", "messages": [{"role": "user", "content": "?"}]}
    answer = ask(http, body, session="0" * 32)
    assert answer.status_code == 404


def test_a_failing_root_model_is_a_bad_gateway_and_leaves_no_session(
    llm_server: ServerThread, http, stub: StubLLM
):
    def down(body: dict[str, Any]) -> str:
        raise StubError(503, "overloaded")

    stub.reset(down)
    before = llm_server.server.manager.session_count
    answer = ask(http, {"model": "rlm:m", "messages": [{"role": "user", "content": "?"}]})
    assert answer.status_code == 502
    assert answer.json()["error"] == {
        "type": "llm_error",
        "message": "the LLM endpoint answered 503: overloaded",
    }
    assert llm_server.server.manager.session_count == before


def test_without_a_backend_the_endpoint_says_so(server):
    answer = httpx.post(
        f"http://127.0.0.1:{server.http_port}/v1/chat/completions",
        json={"model": "rlm:m", "messages": [{"role": "user", "content": "?"}]},
    )
    assert answer.status_code == 404
    assert answer.json()["error"]["type"] == "llm_unavailable"
    assert "--llm-base-url" in answer.json()["error"]["message"]


def test_llm_calls_are_counted_in_metrics(http, stub: StubLLM):
    stub.reset(script)
    ask(
        http,
        {"model": "rlm:stub-model", "messages": [{"role": "user", "content": "?"}], "context": "x"},
    )
    metrics = http.get("/metrics").text
    for sample in (
        'cloche_llm_calls_total{kind="root",model="stub-model",outcome="ok"}',
        'cloche_llm_calls_total{kind="sub",model="stub-model",outcome="ok"}',
        'cloche_llm_tokens_total{kind="prompt",model="stub-model"}',
        'cloche_llm_call_duration_seconds_count{kind="sub",model="stub-model"}',
        'cloche_rlm_runs_total{outcome="ok"}',
    ):
        assert re.search(re.escape(sample) + r" [1-9]", metrics), sample


def test_logs_tell_calls_but_not_prompts(http, stub: StubLLM, caplog: pytest.LogCaptureFixture):
    stub.reset(script)
    caplog.set_level(logging.DEBUG, logger="cloche.llm")
    ask(
        http,
        {
            "model": "rlm:stub-model",
            "messages": [{"role": "user", "content": "?"}],
            "context": f"The magic number is {NEEDLE}.",
        },
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "cloche.llm"]
    assert any(
        re.match(r"llm call session=[\w-]+ kind=sub model=stub-model outcome=ok", x) for x in lines
    )
    assert any(line.startswith("rlm run session=") for line in lines)
    assert not any(NEEDLE in line for line in lines)


def test_prompts_are_logged_only_when_asked(
    make_llm_server, stub: StubLLM, caplog: pytest.LogCaptureFixture
):
    server = make_llm_server(log_prompts=True)
    caplog.set_level(logging.DEBUG, logger="cloche.llm")
    with server.client() as client:
        client.run(f"llm_query('The magic number is {NEEDLE}.')")
    lines = [r.getMessage() for r in caplog.records if r.name == "cloche.llm"]
    assert any(line.startswith("llm prompt session=") and NEEDLE in line for line in lines)
