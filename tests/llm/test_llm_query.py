"""llm_query and llm_query_batched in cells of real gVisor sessions, against the stub."""

from __future__ import annotations

import threading
import time

import httpx

from cloche.config import Limits
from llm.conftest import KEY
from llm.stub import StubError, StubLLM
from support import ServerThread


def run(server: ServerThread, code: str, session_id: str | None = None) -> dict[str, object]:
    with server.client() as client:
        return client.run(code, session_id)


def new_session(server: ServerThread) -> str:
    return str(run(server, "0")["session_id"])


def test_llm_query_returns_the_models_answer(llm_server, stub: StubLLM):
    reply = run(llm_server, "llm_query('What is 6 x 7?')")
    assert reply["status"] == "ok", reply
    assert reply["output"] == "'echo: What is 6 x 7?'\n"
    (request,) = stub.requests
    assert request.body["model"] == "stub-model"
    assert request.body["messages"] == [{"role": "user", "content": "What is 6 x 7?"}]
    assert request.headers["authorization"] == f"Bearer {KEY}"


def test_a_model_can_be_named(llm_server, stub: StubLLM):
    reply = run(llm_server, "llm_query('hi', model='other-model')")
    assert reply["status"] == "ok", reply
    assert [r.body["model"] for r in stub.requests] == ["other-model"]


def test_llm_query_batched_answers_in_order_and_concurrently(llm_server, stub: StubLLM):
    stub.gate(5)  # no answer until all five requests are in flight at once
    started = time.perf_counter()
    reply = run(llm_server, "llm_query_batched([f'q{i}' for i in range(5)])")
    assert reply["status"] == "ok", reply
    assert reply["output"] == str([f"echo: q{i}" for i in range(5)]) + "\n"
    assert stub.max_in_flight == 5
    assert time.perf_counter() - started < 20  # the gate opened: it did not time out


def test_concurrency_is_bounded_per_session(make_llm_server, stub: StubLLM):
    server = make_llm_server(concurrency=2)
    stub.gate(2)  # the first two are held until both are in flight: calls overlap
    reply = run(server, "len(llm_query_batched(['x'] * 6))")
    assert reply["output"] == "6\n", reply
    assert stub.max_in_flight == 2


def test_threads_of_a_cell_can_call_llm_query(llm_server, stub: StubLLM):
    stub.gate(4)
    code = (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "with ThreadPoolExecutor(4) as pool:\n"
        "    answers = list(pool.map(llm_query, ['a', 'b', 'c', 'd']))\n"
        "answers"
    )
    reply = run(llm_server, code)
    assert reply["output"] == "['echo: a', 'echo: b', 'echo: c', 'echo: d']\n", reply
    assert stub.max_in_flight == 4


def test_a_thread_still_waiting_when_its_cell_ends_gets_its_answer(llm_server, stub: StubLLM):
    """The cell ends while a thread it started waits for an answer: the end of the cell
    waits for that answer, and the session's channel stays in step."""
    session = new_session(llm_server)
    stub.block()
    code = (
        "import threading\n"
        "box = []\n"
        "threading.Thread(target=lambda: box.append(llm_query('late'))).start()\n"
        "'cell done'"
    )
    done = threading.Event()
    replies: list[dict[str, object]] = []

    def cell() -> None:
        replies.append(run(llm_server, code, session))
        done.set()

    worker = threading.Thread(target=cell)
    worker.start()
    while len(stub.requests) < 1:  # the thread's request reached the model
        assert worker.is_alive()
        worker.join(0.01)
    assert not done.is_set()  # the cell can't report its end while an answer is owed
    stub.release()
    worker.join(30)
    assert replies[0]["output"] == "'cell done'\n", replies
    assert run(llm_server, "box", session)["output"] == "['echo: late']\n"
    assert run(llm_server, "llm_query('next')", session)["output"] == "'echo: next'\n"


def test_an_endpoint_failure_is_a_clear_error_in_the_cell(llm_server, stub: StubLLM):
    def fail(body: dict[str, object]) -> str:
        raise StubError(500, "the stub is down")

    stub.reset(fail)
    session = new_session(llm_server)
    reply = run(llm_server, "llm_query('x')", session)
    assert reply["cell_status"] == "error"
    assert "LLMError: the LLM endpoint answered 500: the stub is down" in str(reply["error"])
    assert stub.url not in str(reply["error"])
    assert run(llm_server, "1 + 1", session)["output"] == "2\n"


def test_a_refused_key_is_reported_without_quoting_it(llm_server, stub: StubLLM):
    def refuse(body: dict[str, object]) -> str:
        raise StubError(401, f"Incorrect API key provided: {KEY}")

    stub.reset(refuse)
    reply = run(llm_server, "llm_query('x')")
    assert "refused the server's credentials (401)" in str(reply["error"])
    assert KEY not in str(reply)


def test_the_call_budget_stops_a_runaway_loop(make_llm_server, stub: StubLLM):
    server = make_llm_server(max_calls=5)
    session = new_session(server)
    reply = run(server, "n = 0\nwhile True:\n    llm_query('again')\n    n += 1", session)
    assert reply["cell_status"] == "error"
    assert "LLMError: this session has made its 5 LLM calls (--llm-max-calls)" in str(
        reply["error"]
    )
    assert run(server, "n", session)["output"] == "5\n"
    assert len(stub.requests) == 5
    assert run(server, "'alive'", session)["output"] == "'alive'\n"


def test_the_token_budget_stops_calls(make_llm_server, stub: StubLLM):
    server = make_llm_server(max_tokens=250)
    reply = run(server, "while True:\n    llm_query('x' * 200)")
    assert "this session has used 309 LLM tokens, its budget is 250 (--llm-max-tokens)" in str(
        reply["error"]
    ), reply
    assert len(stub.requests) == 3  # the stub counts 103 tokens a call: a 4th is refused


def test_the_cell_timeout_does_not_count_llm_waiting(make_llm_server, stub: StubLLM):
    server = make_llm_server(limits=Limits(cell_timeout_s=1.0, interrupt_grace_s=1.0))
    stub.block()
    releaser = threading.Timer(2.5, stub.release)  # the answer comes after the cell timeout
    releaser.start()
    try:
        reply = run(server, "import time\nt = time.monotonic()\nllm_query('slow')")
    finally:
        releaser.cancel()
    assert reply["cell_status"] == "ok", reply
    assert reply["output"] == "'echo: slow'\n"


def test_the_cell_timeout_still_counts_the_cells_own_time(make_llm_server, stub: StubLLM):
    server = make_llm_server(limits=Limits(cell_timeout_s=1.0, interrupt_grace_s=1.0))
    reply = run(server, "llm_query('quick')\nwhile True: pass")
    assert reply["cell_status"] == "timeout", reply


def test_llm_waiting_is_bounded_by_the_llm_timeout(make_llm_server, stub: StubLLM):
    server = make_llm_server(timeout_s=1.5)
    session = new_session(server)
    stub.block()  # never answers
    reply = run(server, "llm_query('never answered')", session)
    assert reply["cell_status"] == "error", reply
    assert "waited 1.5 s in all (--llm-timeout)" in str(reply["error"])
    stub.release()
    assert run(server, "llm_query('fine')", session)["output"] == "'echo: fine'\n"


def test_an_interrupt_ends_a_cell_waiting_for_the_llm(llm_server, stub: StubLLM):
    session = new_session(llm_server)
    stub.block()
    replies: list[dict[str, object]] = []
    worker = threading.Thread(
        target=lambda: replies.append(run(llm_server, "llm_query('stuck')", session))
    )
    worker.start()
    while len(stub.requests) < 1:
        worker.join(0.01)
    with httpx.Client() as http:
        answer = http.post(
            f"http://127.0.0.1:{llm_server.http_port}/v1/sessions/{session}/interrupt"
        )
    assert answer.json() == {"interrupted": True}
    worker.join(30)
    assert replies[0]["cell_status"] == "interrupted", replies
    stub.release()
    assert run(llm_server, "llm_query('after')", session)["output"] == "'echo: after'\n"


def test_llm_query_is_absent_without_a_backend(server):
    reply = run(server, "llm_query('x')")
    assert "NameError" in str(reply["error"])
