"""The broker: every language-model call of the server, within each session's budgets.

A session's `Budget` counts its calls, tokens and LLM waiting, and bounds its calls in
flight. Batches run concurrently. What fails raises `LLMError` (or `LLMBudgetExceeded`)
with a message that is safe to show inside the sandbox: it never holds the key or the
endpoint's address.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

import openai

from cloche.config import LLMConfig
from cloche.errors import LLMBudgetExceeded, LLMError
from cloche.sessions.observer import Observer

log = logging.getLogger("cloche.llm")

_MAX_MODEL_LABELS = 16  # distinct model names in metrics; the rest are "other"
_MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class Completion:
    """One answer and what it cost."""

    text: str
    prompt_tokens: int
    completion_tokens: int


class Budget:
    """What one session has spent on language models, and its calls in flight."""

    def __init__(self, session_id: str, config: LLMConfig) -> None:
        self.session_id = session_id
        self.calls = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.wait_s = 0.0  # time its cells spent waiting for answers
        self.slots = asyncio.Semaphore(config.concurrency)
        self.default_model: str | None = None  # set by an RLM run: its sub-model
        self.run_lock = asyncio.Lock()  # one RLM run at a time

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Broker:
    """Makes the server's language-model calls."""

    def __init__(self, config: LLMConfig, observer: Observer | None = None) -> None:
        self.config = config
        self.observer = observer or Observer()  # told of each call (the server's metrics)
        self._client = openai.AsyncOpenAI(
            api_key=config.api_key or "unused",
            base_url=config.base_url,
            max_retries=config.max_retries,
            timeout=config.timeout_s,
        )
        self._budgets: weakref.WeakValueDictionary[str, Budget] = weakref.WeakValueDictionary()
        self._model_labels: set[str] = {config.model}

    def budget(self, session_id: str) -> Budget:
        """The session's budget (made on first use; it lives as long as its holders)."""
        budget = self._budgets.get(session_id)
        if budget is None:
            budget = Budget(session_id, self.config)
            self._budgets[session_id] = budget
        return budget

    async def close(self) -> None:
        await self._client.close()

    async def query(
        self, budget: Budget, prompts: list[str], model: str | None = None
    ) -> list[Completion]:
        """One answer per prompt (each a user message), concurrently within the budget.

        Raises:
            LLMBudgetExceeded: the session's calls, tokens or time ran out.
            LLMError: a call failed; the others are cancelled.
        """
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(
                        self.chat(budget, [{"role": "user", "content": prompt}], model)
                    )
                    for prompt in prompts
                ]
        except BaseExceptionGroup as group_error:
            raise _first(group_error) from None
        return [task.result() for task in tasks]

    async def chat(
        self,
        budget: Budget,
        messages: list[dict[str, str]],
        model: str | None = None,
        *,
        kind: str = "sub",
    ) -> Completion:
        """One chat completion, counted in the session's budget.

        kind is "sub" for a cell's call and "root" for an RLM run's own (in logs).
        """
        model = model or budget.default_model or self.config.model
        async with budget.slots:
            self._spend(budget)
            started = time.perf_counter()
            completion: Completion | None = None
            outcome = "error"
            try:
                completion = await self._complete(messages, model)
                outcome = "ok"
                return completion
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            except LLMError as exc:
                outcome = "timeout" if "timed out" in str(exc) else "error"
                raise
            finally:
                seconds = time.perf_counter() - started
                self._finish(budget, model, kind, outcome, seconds, messages, completion)

    def _spend(self, budget: Budget) -> None:
        """Count a call, or refuse it if a budget is spent."""
        config = self.config
        if budget.calls >= config.max_calls:
            self._refused(budget, "calls")
            raise LLMBudgetExceeded(
                f"this session has made its {config.max_calls} LLM calls (--llm-max-calls)"
            )
        if budget.tokens >= config.max_tokens:
            self._refused(budget, "tokens")
            raise LLMBudgetExceeded(
                f"this session has used {budget.tokens} LLM tokens, its budget is "
                f"{config.max_tokens} (--llm-max-tokens)"
            )
        if budget.wait_s >= config.session_time_s:
            self._refused(budget, "time")
            raise LLMBudgetExceeded(
                f"this session's cells have waited {budget.wait_s:.0f} s for LLM answers, "
                f"its budget is {config.session_time_s:g} s (--llm-session-time)"
            )
        budget.calls += 1

    def _refused(self, budget: Budget, which: str) -> None:
        self.observer.llm_refused(which)
        log.info("llm refused session=%s budget=%s", budget.session_id, which)

    async def _complete(self, messages: list[dict[str, str]], model: str) -> Completion:
        try:
            response = await self._client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
            )
        except openai.APITimeoutError:
            raise LLMError(
                f"the LLM call timed out after {self.config.timeout_s:g} s (--llm-timeout)"
            ) from None
        except openai.APIConnectionError:
            raise LLMError("the server could not reach its LLM endpoint") from None
        except openai.APIStatusError as exc:
            raise LLMError(self._status_message(exc)) from None
        except openai.OpenAIError as exc:
            raise LLMError(f"the LLM call failed: {self._clean(str(exc))}") from None
        if not response.choices:
            raise LLMError("the LLM endpoint answered without a choice")
        text = response.choices[0].message.content or ""
        usage = response.usage
        return Completion(
            text=text,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
        )

    def _status_message(self, exc: openai.APIStatusError) -> str:
        status = exc.status_code
        if status in (401, 403):
            # The provider's message may quote part of the key: say nothing of it.
            return f"the LLM endpoint refused the server's credentials ({status})"
        detail = _error_detail(exc.body) or exc.message
        return f"the LLM endpoint answered {status}: {self._clean(detail)}"

    def _clean(self, text: str) -> str:
        """text without the key or the endpoint's address, and short."""
        for secret in (self.config.api_key, self.config.base_url.rstrip("/")):
            if secret:
                text = text.replace(secret, "[hidden]")
        return text[:_MAX_ERROR_CHARS]

    def _model_label(self, model: str) -> str:
        if model in self._model_labels:
            return model
        if len(self._model_labels) < _MAX_MODEL_LABELS:
            self._model_labels.add(model)
            return model
        return "other"

    def _finish(
        self,
        budget: Budget,
        model: str,
        kind: str,
        outcome: str,
        seconds: float,
        messages: list[dict[str, str]],
        completion: Completion | None,
    ) -> None:
        """Count a finished call's tokens, and log it (its text only with log_prompts)."""
        label = self._model_label(model)
        prompt_tokens = completion.prompt_tokens if completion else 0
        completion_tokens = completion.completion_tokens if completion else 0
        budget.prompt_tokens += prompt_tokens
        budget.completion_tokens += completion_tokens
        self.observer.llm_call(label, kind, outcome, seconds, prompt_tokens, completion_tokens)
        log.info(
            "llm call session=%s kind=%s model=%s outcome=%s latency_ms=%.1f prompt_chars=%d "
            "answer_chars=%d prompt_tokens=%d completion_tokens=%d",
            budget.session_id,
            kind,
            label,
            outcome,
            seconds * 1000,
            sum(len(m.get("content", "")) for m in messages),
            len(completion.text) if completion else 0,
            prompt_tokens,
            completion_tokens,
        )
        if self.config.log_prompts:
            log.debug(
                "llm prompt session=%s messages=%r answer=%r",
                budget.session_id,
                messages,
                completion.text if completion else None,
            )


def _error_detail(body: Any) -> str | None:
    """The message of an OpenAI-style error body, if it has one."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return None


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The exception a failed batch stands for: a budget first, else the first error."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        current = pending.pop(0)
        if isinstance(current, BaseExceptionGroup):
            pending += list(current.exceptions)
        else:
            leaves.append(current)
    for exc in leaves:
        if isinstance(exc, LLMBudgetExceeded):
            return exc
    return leaves[0]
