"""The host's side of a kernel's LLM requests: check them, call the broker, answer.

During a cell, the kernel sends `{"op": "llm", "id", "prompts", "model"}` (see
`cloche.kernel.llm`) and blocks until it gets `{"op": "llm_reply", "id", "texts"}` or
`{"op": "llm_reply", "id", "error"}`. The kernel is hostile: a request of the wrong shape
or size raises InvalidMessage, and `KernelClient` kills that sandbox; a request the
budgets refuse is answered with an error, which the cell raises as LLMError. Every
request gets an answer while its cell runs: when the broker fails, when the cell is
interrupted, when its LLM time is up.

While a cell waits for answers its clock is held (its --cell-timeout does not run), for
at most --llm-timeout per cell and --llm-session-time per session; then its calls fail.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Protocol

from cloche.config import LLMConfig
from cloche.errors import InvalidMessage, LLMError
from cloche.llm.broker import Broker, Budget

log = logging.getLogger("cloche.llm")

MAX_IN_FLIGHT = 64  # requests of one cell waiting for answers at once
_MAX_ID = 2**53
_MAX_MODEL_CHARS = 200
_KEYS = frozenset({"op", "id", "prompts", "model"})


class Kernel(Protocol):
    """What the bridge needs of `KernelClient`."""

    def hold_deadline(self, cell: Any, held: bool) -> None: ...

    def send(self, message: dict[str, Any]) -> None: ...


def parse_request(
    message: dict[str, Any], max_batch: int, max_prompt_chars: int
) -> tuple[int, list[str], str | None]:
    """(id, prompts, model) of a kernel's request.

    Raises:
        InvalidMessage: it is not a request the kernel's own code would send.
    """
    if not _KEYS.issuperset(message):
        raise InvalidMessage("LLM request with unknown fields")
    request_id, prompts, model = message.get("id"), message.get("prompts"), message.get("model")
    if type(request_id) is not int or not 0 < request_id < _MAX_ID:
        raise InvalidMessage("LLM request without a valid id")
    if not isinstance(prompts, list) or not 0 < len(prompts) <= max_batch:
        raise InvalidMessage(f"LLM request without 1 to {max_batch} prompts")
    for prompt in prompts:
        if not isinstance(prompt, str) or len(prompt) > max_prompt_chars:
            raise InvalidMessage(f"LLM prompt that is not a str of at most {max_prompt_chars}")
    if model is not None and not (isinstance(model, str) and 0 < len(model) <= _MAX_MODEL_CHARS):
        raise InvalidMessage("LLM request with an invalid model name")
    return request_id, prompts, model


class KernelLLM:
    """Answers one session's LLM requests, a cell at a time."""

    def __init__(self, broker: Broker, budget: Budget, kernel: Kernel) -> None:
        self.broker = broker
        self.budget = budget
        self.kernel = kernel
        self._cell: object | None = None  # the cell whose requests are being answered
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._refusal: str | None = None  # why this cell's calls now fail at once
        self._interrupted = False  # because the cell was interrupted
        self._cell_wait_s = 0.0  # how long this cell has waited for answers
        self._since: float | None = None  # loop time when the cell began waiting
        self._timer: asyncio.TimerHandle | None = None

    def request(self, cell: object, message: dict[str, Any]) -> None:
        """Take a request of the running cell. Raises InvalidMessage."""
        config = self.broker.config
        request_id, prompts, model = parse_request(
            message, config.max_batch, config.max_prompt_chars
        )
        self._enter(cell)
        if request_id in self._tasks:
            raise InvalidMessage("two LLM requests in flight with the same id")
        refusal = self._refusal
        if refusal is None and len(self._tasks) >= MAX_IN_FLIGHT:
            refusal = f"more than {MAX_IN_FLIGHT} LLM requests in flight in one cell"
        if refusal is not None:
            self.kernel.send(self._refused(request_id, refusal))
            return
        if not self._tasks:
            self._hold(cell)
        task = asyncio.create_task(self._answer(cell, request_id, prompts, model))
        self._tasks[request_id] = task
        task.add_done_callback(functools.partial(self._done, cell, request_id))

    def stop(self, cell: object, why: str, *, interrupted: bool = False) -> None:
        """Fail the cell's calls, those in flight and those to come.

        With interrupted, the cell's main thread raises KeyboardInterrupt, not LLMError.
        """
        self._enter(cell)
        if self._refusal is None:
            self._refusal = why
            self._interrupted = interrupted
        for task in self._tasks.values():
            task.cancel()

    def end(self, cell: object) -> None:
        """The cell is over: nothing more is sent for it."""
        if cell is None or cell is not self._cell:
            return
        self._refusal = "the cell has ended"
        self._release(cell)
        self._cell = None
        for task in self._tasks.values():
            task.cancel()
        self._tasks = {}

    def _enter(self, cell: object) -> None:
        if cell is not self._cell:
            self.end(self._cell)
            self._cell = cell
            self._refusal = None
            self._interrupted = False
            self._cell_wait_s = 0.0

    async def _answer(
        self, cell: object, request_id: int, prompts: list[str], model: str | None
    ) -> None:
        reply: dict[str, Any] = {"op": "llm_reply", "id": request_id}
        try:
            completions = await self.broker.query(self.budget, prompts, model)
            reply["texts"] = [completion.text for completion in completions]
        except LLMError as exc:
            reply["error"] = str(exc)
        except asyncio.CancelledError:
            self._reply(cell, self._refused(request_id, self._refusal or "cancelled"))
            raise
        except Exception:
            log.exception("LLM request failed")
            reply["error"] = "the LLM call failed inside the server"
        self._reply(cell, reply)

    def _refused(self, request_id: int, why: str) -> dict[str, Any]:
        reply = {"op": "llm_reply", "id": request_id, "error": why}
        if self._interrupted and why == self._refusal:
            reply["interrupted"] = True
        return reply

    def _reply(self, cell: object, reply: dict[str, Any]) -> None:
        if cell is self._cell:  # not after the cell's end: the kernel reads no more
            self.kernel.send(reply)

    def _done(self, cell: object, request_id: int, task: asyncio.Task[None]) -> None:
        if cell is self._cell:
            self._tasks.pop(request_id, None)
            if not self._tasks:
                self._release(cell)

    def _hold(self, cell: object) -> None:
        """The cell starts waiting: stop its clock, start the LLM one."""
        config = self.broker.config
        loop = asyncio.get_running_loop()
        self._since = loop.time()
        self.kernel.hold_deadline(cell, True)
        cell_left = config.timeout_s - self._cell_wait_s
        session_left = config.session_time_s - self.budget.wait_s
        if cell_left <= session_left:
            why = f"this cell's LLM calls have waited {config.timeout_s:g} s in all (--llm-timeout)"
        else:
            why = (
                f"this session's LLM calls have waited {config.session_time_s:g} s in all "
                "(--llm-session-time)"
            )
        self._timer = loop.call_later(max(0.0, min(cell_left, session_left)), self.stop, cell, why)

    def _release(self, cell: object) -> None:
        """The cell stops waiting: count the time, restart its clock."""
        if self._since is None:
            return
        elapsed = asyncio.get_running_loop().time() - self._since
        self._since = None
        self._cell_wait_s += elapsed
        self.budget.wait_s += elapsed
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.kernel.hold_deadline(cell, False)


def install_code(config: LLMConfig, max_frame_bytes: int) -> str:
    """The silent code that switches llm_query on in a kernel as it starts."""
    return (
        "\nimport cloche.kernel.llm as _llm\n"
        f"_llm.install(max_prompt_chars={config.max_prompt_chars}, "
        f"max_batch={config.max_batch}, max_request_bytes={max_frame_bytes})\n"
    )


class SessionsLLM:
    """A session manager's way to `llm_query` (`cloche.sessions.hookups.LLMHookup`): the
    broker, handed down by whoever made it (the server, or a cluster node's agent)."""

    def __init__(self, broker: Broker, max_frame_bytes: int) -> None:
        self.broker = broker
        self.setup_code = install_code(broker.config, max_frame_bytes)

    def for_kernel(self, session_id: str, kernel: Kernel) -> KernelLLM:
        return KernelLLM(self.broker, self.broker.budget(session_id), kernel)
