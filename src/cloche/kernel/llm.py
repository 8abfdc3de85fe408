"""llm_query and llm_query_batched: language-model calls that the host makes for a cell.

The sandbox has no network and no key: a call travels over the kernel's channel, the host
makes the request (within the session's budgets) and answers it.

    kernel -> host  {"op": "llm", "id": int, "prompts": [str, ...], "model": str | None}
    host -> kernel  {"op": "llm_reply", "id": int, "texts": [str, ...]}
                    {"op": "llm_reply", "id": int, "error": str}

While a cell runs, the serve loop (the channel's usual reader) is busy running it; so the
callers waiting for replies read the channel themselves, one at a time, each reply going
to its caller (threads of the cell may call too), anything else to the kernel's `route`.
Calls are accepted only while a cell runs, and the end of a cell waits for every reply
still owed, so the serve loop never meets one. In the main thread, SIGINT is held back for
the length of a call: an interrupt in the middle of a frame would break the framing. The
host answers an interrupted cell's calls at once, so the hold is short.

The host also uses this module, through silent cells, to switch the functions on
(`install`) and to load a session's context into the variable `context` (`load_context`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

from .channel import Channel

_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_ENVELOPE_BYTES = 2048  # a request without its prompts (id, model, keys), at most
_MAX_MODEL_CHARS = 200
_REPLIES = ("llm_reply", "pip_reply", "input_reply")  # the host's answers to a cell's asks


class LLMError(Exception):
    """A language-model call failed: a budget ran out, it took too long, or the model's
    endpoint failed. The message says which, and the setting that governs it."""


class _Interrupted(LLMError):
    """The host stopped the call because the cell was interrupted."""


class Bridge:
    """The kernel's end of its LLM calls: requests out, replies in, over the channel."""

    def __init__(self, channel: Channel, namespace: dict[str, Any]) -> None:
        global _bridge
        _bridge = self
        self._channel = channel
        self._namespace = namespace
        self._workdir = os.getcwd()
        self._cond = threading.Condition(threading.Lock())
        self._open = False  # a cell runs: calls are accepted
        self._reading = False  # a caller is reading the channel
        self.route: Callable[[dict[str, Any]], None] = lambda message: None  # not a reply
        self._owed: set[int] = set()  # requests sent whose reply has not been read
        self._replies: dict[int, dict[str, Any]] = {}  # read, not yet taken by their caller
        self._next_id = 1
        self._lost = False  # the host closed the channel
        self._holding = False  # the main thread is in a call: SIGINT waits for its end
        self._held = False  # a SIGINT arrived meanwhile
        self.enabled = False
        self.max_prompt_chars = 0
        self.max_batch = 0
        self.max_request_bytes = 0

    def install(self, max_prompt_chars: int, max_batch: int, max_request_bytes: int) -> None:
        """Put llm_query, llm_query_batched and LLMError in the session's globals."""
        self.max_prompt_chars = max_prompt_chars
        self.max_batch = max_batch
        self.max_request_bytes = max_request_bytes
        self.enabled = True
        self._namespace.update(
            llm_query=llm_query, llm_query_batched=llm_query_batched, LLMError=LLMError
        )

    def load_context(self, name: str, kind: str) -> None:
        """Read the context the host put in the working directory into `context`."""
        with open(os.path.join(self._workdir, name), encoding="utf-8", errors="replace") as file:
            value = json.load(file) if kind == "json" else file.read()
        self._namespace["context"] = value

    # -- the cell's side ------------------------------------------------------------------

    def cell(self, running: bool) -> None:
        """A cell starts (calls are accepted) or ends (wait for every reply still owed)."""
        if not self.enabled:
            return
        with self._cond:
            self._open = running
            while not running and self._owed and not self._lost:
                self._read_or_wait()

    def hold_interrupt(self) -> bool:
        """Called by the SIGINT handler: True if the interrupt must wait for a call's end."""
        if self._holding:
            self._held = True
            return True
        return False

    def call(self, prompts: list[str], model: str | None) -> list[str]:
        """Ask the host for one answer per prompt. Raises LLMError."""
        if not prompts:
            return []
        requests = self._split(prompts, model)
        main = threading.current_thread() is threading.main_thread()
        if main:
            self._holding = True
        try:
            texts = self._call(requests, model)
        except _Interrupted as exc:
            if not main:
                raise LLMError(str(exc)) from None
            self._held = True  # the host's SIGINT may come after its answer
        finally:
            if main:
                self._holding = False
        if main and self._held:
            self._held = False
            raise KeyboardInterrupt
        return texts

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send a request of the main thread (a `%pip install`) and wait for its reply, read
        as LLM replies are; SIGINT waits meanwhile, and KeyboardInterrupt follows the reply
        when the host answered it as interrupted."""
        with self._cond:
            request_id = self._next_id
            self._next_id += 1
            self._owed.add(request_id)
        self._holding = True
        try:
            self._channel.send({**message, "id": request_id})
            with self._cond:
                while request_id not in self._replies:
                    if self._lost:
                        raise ConnectionError("the host closed the channel")
                    self._read_or_wait()
                reply = self._replies.pop(request_id)
        finally:
            self._holding = False
        if self._held or reply.get("interrupted") is True:
            self._held = False
            raise KeyboardInterrupt
        return reply

    def _split(self, prompts: list[str], model: str | None) -> list[list[str]]:
        """Prompts in groups that each fit in one frame and one batch."""
        if model is not None and (not isinstance(model, str) or len(model) > _MAX_MODEL_CHARS):
            raise TypeError(f"model must be None or a model's name (at most {_MAX_MODEL_CHARS})")
        groups: list[list[str]] = [[]]
        size = _ENVELOPE_BYTES
        for prompt in prompts:
            if not isinstance(prompt, str):
                raise TypeError(f"a prompt must be a str, not {type(prompt).__name__}")
            if len(prompt) > self.max_prompt_chars:
                raise LLMError(
                    f"a prompt of {len(prompt)} characters is over the server's limit of "
                    f"{self.max_prompt_chars} (--llm-max-prompt-chars): send smaller pieces"
                )
            encoded = len(_encoder.encode(prompt).encode("utf-8", "backslashreplace")) + 1
            if encoded + _ENVELOPE_BYTES > self.max_request_bytes:
                raise LLMError(
                    f"a prompt of {encoded} bytes is over the server's frame limit of "
                    f"{self.max_request_bytes} bytes (--max-frame-bytes): send smaller pieces"
                )
            if groups[-1] and (
                size + encoded > self.max_request_bytes or len(groups[-1]) >= self.max_batch
            ):
                groups.append([])
                size = _ENVELOPE_BYTES
            groups[-1].append(prompt)
            size += encoded
        return groups

    def _call(self, requests: list[list[str]], model: str | None) -> list[str]:
        ids = []
        with self._cond:
            if not self._open:
                raise LLMError("llm_query can be called only while a cell runs")
            for _ in requests:
                ids.append(self._next_id)
                self._owed.add(self._next_id)
                self._next_id += 1
        for request_id, prompts in zip(ids, requests, strict=True):
            self._channel.send({"op": "llm", "id": request_id, "prompts": prompts, "model": model})
        texts: list[str] = []
        error: str | None = None
        interrupted = False
        with self._cond:
            for request_id, prompts in zip(ids, requests, strict=True):
                while request_id not in self._replies:
                    if self._lost:
                        raise LLMError("the host closed the channel")
                    self._read_or_wait()
                reply = self._replies.pop(request_id)
                answers = reply.get("texts")
                if error is None and isinstance(reply.get("error"), str):
                    error = reply["error"]
                    interrupted = reply.get("interrupted") is True
                elif isinstance(answers, list) and len(answers) == len(prompts):
                    texts += [str(text) for text in answers]
                elif error is None:
                    error = "the host sent a malformed reply"
        if error is not None:
            raise (_Interrupted if interrupted else LLMError)(error)
        return texts

    def _read_or_wait(self) -> None:
        """With the lock held: read one frame if nobody is reading, else wait for a reader."""
        if self._reading:
            self._cond.wait()
            return
        self._reading = True
        self._cond.release()
        try:
            message = self._channel.recv()
        except Exception:  # the host sends valid frames; anything else means it is gone
            message = None
        finally:
            self._cond.acquire()
            self._reading = False
            self._cond.notify_all()
        if message is None:
            self._lost = True
            return
        request_id = message.get("id")
        if message.get("op") in _REPLIES:
            if request_id in self._owed:
                self._owed.discard(request_id)
                self._replies[request_id] = message
        else:
            self.route(message)


_bridge: Bridge | None = None


def _current() -> Bridge:
    if _bridge is None or not _bridge.enabled:
        raise LLMError("this server has no language model configured (--llm-base-url)")
    return _bridge


def llm_query(prompt: str, model: str | None = None) -> str:
    """Ask a language model; return its answer.

    The server makes the call (the sandbox has no network), within this session's budgets.

    Args:
        prompt: The whole prompt, as one user message.
        model: A model's name; None for the server's default.

    Raises:
        LLMError: a budget ran out, the call took too long, or the model's endpoint failed.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, not {type(prompt).__name__}")
    return _current().call([prompt], model)[0]


def llm_query_batched(prompts: list[str], model: str | None = None) -> list[str]:
    """Ask a language model many prompts at once, concurrently; answers in the same order.

    Much faster than calling llm_query in a loop.

    Raises:
        LLMError: as llm_query, if any of the calls fails.
    """
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of str; for one prompt use llm_query")
    return _current().call(list(prompts), model)


def install(max_prompt_chars: int, max_batch: int, max_request_bytes: int) -> None:
    """Switch llm_query on in this kernel (the host runs this in a silent cell)."""
    assert _bridge is not None
    _bridge.install(max_prompt_chars, max_batch, max_request_bytes)


def load_context(name: str, kind: str) -> None:
    """Load the working directory's context file into `context` (from a silent cell)."""
    assert _bridge is not None
    _bridge.load_context(name, kind)
