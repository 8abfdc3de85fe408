"""The kernel's reader of its channel (cloche.kernel.router) over real pipes: between cells
the main thread reads its cells itself (no thread's hand-off on the warm cell's path); while
a cell runs, the router's thread reads and routes; the turn passes without losing,
reordering or half-reading a frame."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cloche.kernel.channel import Channel
from cloche.kernel.router import Router
from cloche.protocol.framing import encode_frame

WAIT_S = 10.0


class Recorder:
    """Stands in for the LLM bridge: records what is delivered to it, and by which thread."""

    def __init__(self) -> None:
        self.delivered: list[tuple[str, dict[str, Any]]] = []
        self.changed = threading.Condition()
        self.gone = threading.Event()

    def deliver(self, message: dict[str, Any]) -> None:
        with self.changed:
            self.delivered.append((threading.current_thread().name, message))
            self.changed.notify_all()

    def lost(self) -> None:
        self.gone.set()

    def wait(self, count: int) -> list[tuple[str, dict[str, Any]]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.delivered) >= count, WAIT_S)
            return list(self.delivered)


class Kernel:
    """A router over pipes, a host's write end, and which thread read each frame."""

    def __init__(self) -> None:
        to_kernel_r, self.to_kernel_w = os.pipe()
        self.from_kernel_r, from_kernel_w = os.pipe()
        self.channel = Channel(to_kernel_r, from_kernel_w)
        self.readers: list[str] = []
        receive = self.channel.recv

        def recording(wake_fd: int | None = None) -> dict[str, Any] | None:
            message = receive(wake_fd)
            if message is not None and message.get("op") != "woken":
                self.readers.append(threading.current_thread().name)
            return message

        self.channel.recv = recording  # type: ignore[method-assign]
        self.bridge = Recorder()
        self.router = Router(self.channel, self.bridge, None)  # type: ignore[arg-type]
        self.router.start()

    def send(self, *messages: dict[str, Any]) -> None:
        os.write(self.to_kernel_w, b"".join(encode_frame(m) for m in messages))

    def next_cell(self) -> dict[str, Any] | None:
        """router.next_cell in a thread of the test, bounded: a hang fails the test."""
        got: list[dict[str, Any] | None] = []
        caller = threading.Thread(target=lambda: got.append(self.router.next_cell()))
        caller.name = "main"
        caller.start()
        caller.join(WAIT_S)
        assert got, "next_cell did not return"
        return got[0]

    def close(self) -> None:
        try:
            os.close(self.to_kernel_w)  # the router reads EOF, if it reads
        except OSError:  # closed by the test
            pass
        if not self.router.thread.is_alive() or self.router._routers_turn:
            self.router.close(WAIT_S)  # before its fd is closed: numbers are reused
        for fd in (self.from_kernel_r, self.channel._write_fd):
            os.close(fd)
        self.channel.close()


@pytest.fixture
def kernel() -> Iterator[Kernel]:
    made = Kernel()
    yield made
    made.close()


def cell(code: str) -> dict[str, Any]:
    return {"op": "exec", "code": code}


def reply(n: int) -> dict[str, Any]:
    return {"op": "llm_reply", "id": n, "texts": [str(n)]}


def test_between_cells_the_caller_reads_its_cell_and_routes_what_comes_before(kernel):
    kernel.send(reply(1), cell("1 + 1"))
    assert kernel.next_cell() == cell("1 + 1")
    assert kernel.readers == ["main", "main"]
    assert kernel.bridge.wait(1) == [("main", reply(1))]


def test_while_a_cell_runs_the_router_reads_and_routes(kernel):
    kernel.send(cell("llm_query('x')"))
    assert kernel.next_cell() == cell("llm_query('x')")
    kernel.send(reply(1))
    assert kernel.bridge.wait(1) == [("cloche-router", reply(1))]


def test_cells_sent_before_the_turn_comes_back_are_neither_lost_nor_reordered(kernel):
    kernel.send(cell("a"))
    assert kernel.next_cell() == cell("a")
    kernel.send(cell("b"), reply(1), cell("c"))
    kernel.bridge.wait(1)  # the router read past b: the cells queue behind the reply
    assert kernel.next_cell() == cell("b")
    assert kernel.next_cell() == cell("c")
    kernel.send(reply(2), cell("d"))
    assert kernel.next_cell() == cell("d")
    assert [m["id"] for _, m in kernel.bridge.wait(2)] == [1, 2]


def test_a_frame_half_read_by_the_router_is_finished_by_the_caller(kernel):
    kernel.send(cell("a"))
    assert kernel.next_cell() == cell("a")
    frame = encode_frame(cell("b" * 1000))
    os.write(kernel.to_kernel_w, frame[:500])
    deadline = time.monotonic() + WAIT_S
    while len(kernel.channel._buffer) < 500:  # until the router has read the half
        assert time.monotonic() < deadline, "the router never read the frame's first half"
        time.sleep(0.01)
    os.write(kernel.to_kernel_w, frame[500:])
    assert kernel.next_cell() == cell("b" * 1000)


def test_the_host_gone_while_a_cell_runs_ends_the_kernel_without_a_hang(kernel):
    kernel.send(cell("a"))
    assert kernel.next_cell() == cell("a")
    os.close(kernel.to_kernel_w)
    assert kernel.bridge.gone.wait(WAIT_S)
    assert kernel.next_cell() is None


def test_the_host_gone_between_cells_ends_the_kernel(kernel):
    kernel.send(reply(1))
    os.close(kernel.to_kernel_w)
    assert kernel.next_cell() is None
    assert kernel.bridge.wait(1) == [("main", reply(1))] and kernel.bridge.gone.is_set()
