"""A small OpenAI-compatible endpoint for tests: scripted answers, recorded requests.

`StubLLM` serves `POST /v1/chat/completions` on 127.0.0.1 from its own thread and event
loop. Each request is recorded (body, headers, client address) and answered by `respond`,
a function of the request's body that returns the answer's text (or raises `StubError` to
answer an HTTP error). `gate(n)` holds every answer until n requests are in flight at
once, which proves that calls are concurrent; `block()` holds them until `release()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

GATE_TIMEOUT_S = 30.0


class StubError(Exception):
    """Raised by a responder: the stub answers this HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Recorded:
    body: dict[str, Any]
    headers: dict[str, str]
    client: str
    usage: dict[str, int] = field(default_factory=dict)  # what the stub answered

    @property
    def prompt(self) -> str:
        """The last message's text (a sub-call's whole prompt)."""
        return str(self.body["messages"][-1]["content"])

    @property
    def is_root(self) -> bool:
        return self.body["messages"][0]["role"] == "system"


def echo(body: dict[str, Any]) -> str:
    return "echo: " + str(body["messages"][-1]["content"])


@dataclass
class _Gate:
    size: int
    reached: bool = False
    waiters: list[asyncio.Future[None]] = field(default_factory=list)


class _Quiet(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class StubLLM:
    """The endpoint; use as a context manager."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.respond: Callable[[dict[str, Any]], str] = echo
        self.in_flight = 0
        self.max_in_flight = 0
        self._gate: _Gate | None = None
        self._blocked: asyncio.Event | None = None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        app = Starlette(routes=[Route("/v1/chat/completions", self._complete, methods=["POST"])])
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self._server = _Quiet(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> StubLLM:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the stub LLM did not start")
            self._thread.join(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        finally:
            loop.close()

    def reset(self, respond: Callable[[dict[str, Any]], str] = echo) -> None:
        """Forget the requests, and answer with respond from now on."""
        self.release()
        with self._lock:
            self.requests = []
            self.respond = respond
            self.max_in_flight = 0
            self._gate = None

    def gate(self, size: int) -> None:
        """Hold answers until size requests are in flight at once (or GATE_TIMEOUT_S)."""
        self._gate = _Gate(size)

    def block(self) -> None:
        """Hold every answer until release()."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._set_blocked, asyncio.Event())

    def release(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._set_blocked, None)

    def _set_blocked(self, event: asyncio.Event | None) -> None:
        if self._blocked is not None:
            self._blocked.set()
        self._blocked = event

    async def _complete(self, request: Request) -> JSONResponse:
        body = await request.json()
        record = Recorded(
            body=body,
            headers=dict(request.headers),
            client=request.client.host if request.client else "",
        )
        with self._lock:
            self.requests.append(record)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self._wait_gate()
            if self._blocked is not None:
                await self._blocked.wait()
            try:
                text = self.respond(body)
            except StubError as exc:
                return JSONResponse(
                    {"error": {"message": str(exc), "type": "stub"}}, status_code=exc.status
                )
        finally:
            self.in_flight -= 1
        prompt_chars = sum(len(str(m.get("content", ""))) for m in body["messages"])
        usage = {
            "prompt_tokens": prompt_chars // 4 + 1,
            "completion_tokens": len(text) // 4 + 1,
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        record.usage = usage
        return JSONResponse(
            {
                "id": f"stub-{len(self.requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": body.get("model", ""),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            }
        )

    async def _wait_gate(self) -> None:
        gate = self._gate
        if gate is None or gate.reached:
            return
        if self.in_flight >= gate.size:
            gate.reached = True
            for waiter in gate.waiters:
                if not waiter.done():
                    waiter.set_result(None)
            return
        waiter = asyncio.get_running_loop().create_future()
        gate.waiters.append(waiter)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter, GATE_TIMEOUT_S)
