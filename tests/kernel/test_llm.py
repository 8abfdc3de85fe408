"""The kernel's side of llm_query (cloche.kernel.llm), over a real channel on pipes, with a
host played by a thread of the test."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cloche.kernel.channel import Channel
from cloche.kernel.llm import Bridge, LLMError
from cloche.protocol.framing import FrameDecoder, decode_body, encode_frame

Answer = Callable[[dict[str, Any]], dict[str, Any] | None]


def echo(request: dict[str, Any]) -> dict[str, Any]:
    return {"op": "llm_reply", "id": request["id"], "texts": [f"<{p}>" for p in request["prompts"]]}


class FakeHost:
    """Reads the kernel's requests and answers them with `answer` (None: no answer yet)."""

    def __init__(self, answer: Answer = echo) -> None:
        to_kernel_r, self.to_kernel_w = os.pipe()
        self.from_kernel_r, from_kernel_w = os.pipe()
        self.channel = Channel(to_kernel_r, from_kernel_w)
        self.answer = answer
        self.requests: list[dict[str, Any]] = []
        self.arrived = threading.Condition()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        decoder = FrameDecoder(1 << 26)
        while data := os.read(self.from_kernel_r, 1 << 16):
            for body in decoder.feed(data):
                request = decode_body(body)
                with self.arrived:
                    self.requests.append(request)
                    self.arrived.notify_all()
                reply = self.answer(request)
                if reply is not None:
                    self.send(reply)

    def send(self, message: dict[str, Any]) -> None:
        os.write(self.to_kernel_w, encode_frame(message))

    def wait_requests(self, count: int) -> list[dict[str, Any]]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.requests) >= count, 10)
            return list(self.requests)

    def close(self) -> None:
        os.close(self.to_kernel_w)  # the kernel reads EOF
        os.close(self._kernel_write_fd())
        self._thread.join(10)
        os.close(self.from_kernel_r)
        self.channel._reader.close()

    def _kernel_write_fd(self) -> int:
        return self.channel._write_fd


@pytest.fixture
def host() -> Iterator[FakeHost]:
    running = FakeHost()
    yield running
    running.close()


def bridge_for(host: FakeHost, max_request_bytes: int = 1 << 20) -> tuple[Bridge, dict[str, Any]]:
    """A bridge whose callers read their replies from the channel themselves."""
    namespace: dict[str, Any] = {}
    bridge = Bridge(host.channel, namespace)
    bridge.install(max_prompt_chars=10_000, max_batch=4, max_request_bytes=max_request_bytes)
    return bridge, namespace


def test_install_puts_the_functions_in_the_namespace(host):
    _, namespace = bridge_for(host)
    assert {"llm_query", "llm_query_batched", "LLMError"} <= set(namespace)


def test_a_call_sends_a_request_and_returns_the_answers(host):
    bridge, namespace = bridge_for(host)
    bridge.cell(True)
    assert namespace["llm_query"]("hi") == "<hi>"
    assert namespace["llm_query_batched"](["a", "b"], model="m") == ["<a>", "<b>"]
    bridge.cell(False)
    assert host.requests == [
        {"op": "llm", "id": 1, "prompts": ["hi"], "model": None},
        {"op": "llm", "id": 2, "prompts": ["a", "b"], "model": "m"},
    ]


def test_calls_outside_a_cell_are_refused(host):
    _, namespace = bridge_for(host)
    with pytest.raises(LLMError, match="only while a cell runs"):
        namespace["llm_query"]("hi")
    assert host.requests == []


def test_batches_are_split_to_fit_frames_and_the_batch_limit(host):
    prompts = [str(i) * 1000 for i in range(10)]  # 1003 bytes each in a request
    bridge, namespace = bridge_for(host, max_request_bytes=2048 + 3 * 1003)
    bridge.cell(True)
    assert namespace["llm_query_batched"](prompts) == [f"<{p}>" for p in prompts]
    bridge.cell(False)
    assert [len(r["prompts"]) for r in host.requests] == [3, 3, 3, 1]
    other = FakeHost()  # a kernel has one bridge on its channel: a second needs its own
    try:
        bridge, namespace = bridge_for(other)  # frames large enough: 4 a batch (max_batch)
        bridge.cell(True)
        assert namespace["llm_query_batched"](prompts) == [f"<{p}>" for p in prompts]
        bridge.cell(False)
        assert [len(r["prompts"]) for r in other.requests] == [4, 4, 2]
    finally:
        other.close()


def test_bad_prompts_fail_before_anything_is_sent(host):
    bridge, namespace = bridge_for(host)
    bridge.cell(True)
    with pytest.raises(LLMError, match="over the server's limit of 10000"):
        namespace["llm_query"]("x" * 10_001)
    with pytest.raises(TypeError):
        namespace["llm_query_batched"](["ok", 3])
    with pytest.raises(TypeError):
        namespace["llm_query_batched"]("not a list")
    assert namespace["llm_query_batched"]([]) == []
    bridge.cell(False)
    assert host.requests == []


def test_an_error_answer_is_raised_as_llm_error(host):
    host.answer = lambda r: {"op": "llm_reply", "id": r["id"], "error": "budget spent"}
    bridge, namespace = bridge_for(host)
    bridge.cell(True)
    with pytest.raises(LLMError, match="budget spent"):
        namespace["llm_query"]("x")
    bridge.cell(False)


def test_sigint_during_a_call_waits_for_the_answer(host):
    """An interrupt in the middle of reading a frame would break the framing: it is held
    until the call ends, then raised."""
    bridge, namespace = bridge_for(host)

    def interrupt_then_answer(request: dict[str, Any]) -> dict[str, Any]:
        os.kill(os.getpid(), signal.SIGINT)
        return echo(request)

    host.answer = interrupt_then_answer

    def on_sigint(signum: int, frame: object) -> None:
        if not bridge.hold_interrupt():
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        bridge.cell(True)
        with pytest.raises(KeyboardInterrupt):
            namespace["llm_query"]("x")
        host.answer = echo
        assert namespace["llm_query"]("after") == "<after>"  # the channel is in step
        bridge.cell(False)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_interrupted_answer_is_keyboard_interrupt_in_the_main_thread_only(host):
    host.answer = lambda r: {"op": "llm_reply", "id": r["id"], "error": "no", "interrupted": True}
    bridge, namespace = bridge_for(host)
    bridge.cell(True)
    with pytest.raises(KeyboardInterrupt):
        namespace["llm_query"]("x")
    errors: list[BaseException] = []

    def in_thread() -> None:
        try:
            namespace["llm_query"]("y")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join(10)
    bridge.cell(False)
    assert [type(e) for e in errors] == [LLMError]


def test_threads_share_the_channel_and_the_end_of_a_cell_waits_for_them(host):
    """Several threads wait at once; answers come in another order than requests; the
    cell's end waits until every answer owed was read."""
    held: list[dict[str, Any]] = []
    host.answer = lambda r: held.append(r) and None  # type: ignore[func-returns-value]
    bridge, namespace = bridge_for(host)
    bridge.cell(True)
    results: dict[str, str] = {}
    threads = [
        threading.Thread(target=lambda p=p: results.update({p: namespace["llm_query"](p)}))
        for p in ("a", "b", "c")
    ]
    for thread in threads:
        thread.start()
    host.wait_requests(3)
    ended = threading.Event()
    closer = threading.Thread(target=lambda: (bridge.cell(False), ended.set()))
    closer.start()
    for request in reversed(held):
        assert not ended.is_set()
        host.send(echo(request))
    closer.join(10)
    for thread in threads:
        thread.join(10)
    assert ended.is_set()
    assert results == {"a": "<a>", "b": "<b>", "c": "<c>"}


def test_a_host_that_goes_away_fails_the_call(host):
    host.answer = lambda r: None
    bridge, namespace = bridge_for(host)
    bridge.cell(True)
    os.close(host.to_kernel_w)
    host.to_kernel_w = os.open(os.devnull, os.O_WRONLY)  # for close()
    with pytest.raises(LLMError, match="closed the channel"):
        namespace["llm_query"]("x")
    bridge.cell(False)


def test_load_context_sets_the_variable(host, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "context.json").write_text('{"a": [1, 2]}')
    (tmp_path / "context.txt").write_text("plain text")
    bridge, namespace = bridge_for(host)
    bridge.load_context("context.json", "json")
    assert namespace["context"] == {"a": [1, 2]}
    bridge.load_context("context.txt", "text")
    assert namespace["context"] == "plain text"
