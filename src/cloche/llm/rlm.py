"""Recursive Language Models: a root model answers a query by writing code against a REPL
session that holds the context, and calls sub-models on pieces of it with `llm_query`.

One run: the root model is told about the REPL (the variable `context`, `llm_query`,
`llm_query_batched`) and given the query. Each of its turns may hold code blocks fenced as
```repl; each runs in the session, and what it printed (cut to --rlm-output-chars) is the
next user turn. A turn with FINAL(answer) or FINAL_VAR(variable) ends the run; after
--rlm-max-iterations turns the model is asked for its answer once more, without code.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cloche.errors import KernelDied, LLMError
from cloche.llm.broker import Broker, Budget
from cloche.sessions.manager import SessionManager
from cloche.sessions.result import CellResult, CellStatus

log = logging.getLogger("cloche.llm")

ROOT_PROMPT = """\
You answer a query about a context that may be far too large to read at once. The context \
is loaded in a Python REPL that you drive, as the variable `context` ({context_info}).

The REPL is one persistent Python session: variables, imports and functions stay from one \
code block to the next. In it you have:
- `context`: the context.
- `llm_query(prompt: str) -> str`: asks a language model (it can read a few hundred \
thousand characters at once). Use it to read, search or summarise pieces of the context.
- `llm_query_batched(prompts: list[str]) -> list[str]`: asks many prompts concurrently, in \
order; far faster than calling llm_query in a loop.
- `print(...)`: the only way to see values. Output longer than {output_chars} characters \
is cut, so print sizes, samples and answers, not the whole context.

To run code, write it in a block fenced as repl:
```repl
print(type(context), len(context))
print(context[:500])
```
You then see its output and continue. Work in steps: look at the context's shape, split it \
into pieces, ask llm_query (batched when you can) about each piece, keep the answers in \
variables, and combine them. The sandbox has no network; llm_query is the only way out.

When you know the answer, reply with FINAL(your answer) on its own line, or \
FINAL_VAR(variable_name) to answer with the value of a REPL variable. Do not answer before \
you have looked at the context.\
"""

FIRST_TURN = (
    "Query: {query}\n\nYou have not looked at the context yet. Start by examining it in the "
    "REPL; your answer must come from it."
)
NEXT_TURN = (
    "Output of your code:\n\n{outputs}\n\nContinue. When you have the answer, reply with "
    "FINAL(answer) or FINAL_VAR(variable_name)."
)
NO_CODE_TURN = (
    "Your reply had no ```repl code block and no FINAL answer. Write code to examine "
    "`context`, or answer with FINAL(answer) or FINAL_VAR(variable_name)."
)
LAST_TURN = (
    "You have used all {turns} turns. Reply now with your final answer to the query, as "
    "FINAL(answer), without code."
)

_CODE = re.compile(r"```repl[^\n]*\n(.*?)```", re.DOTALL)
_FINAL_VAR = re.compile(r"^\s*FINAL_VAR\(\s*['\"]?([A-Za-z_]\w*)['\"]?\s*\)", re.MULTILINE)
_FINAL = re.compile(r"^\s*FINAL\((.*)\)\s*$", re.MULTILINE | re.DOTALL)
_MAX_QUERY_CHARS = 20_000  # of the query in the root prompt (the whole of it is in context)
_MAX_ANSWER_CHARS = 1_000_000  # of a FINAL_VAR's value


@dataclass(frozen=True)
class RLMResult:
    """The answer of a run and what it cost (root and sub-calls together)."""

    answer: str
    iterations: int
    finished: bool  # the model gave FINAL; False if it was cut off after the last turn
    prompt_tokens: int
    completion_tokens: int


class RLM:
    """Runs the RLM loop in sessions of a manager, with the manager's broker."""

    def __init__(
        self, manager: SessionManager, broker: Broker, *, max_iterations: int, output_chars: int
    ) -> None:
        self.manager = manager
        self.broker = broker
        self.max_iterations = max_iterations
        self.output_chars = output_chars

    async def run(
        self,
        session_id: str,
        owner: str | None,
        query: str,
        model: str | None = None,
        *,
        gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> RLMResult:
        """Answer query from the session's `context`.

        Args:
            session_id: The session whose REPL (and context) the run uses.
            owner: Its owner's token.
            query: The question.
            model: The model of the root and, by default, of llm_query; None for the
                server's.
            gone: Tells whether the client went away (checked between turns).

        Raises:
            LLMError: a root call failed (LLMBudgetExceeded when a budget ran out).
            KernelDied: the session was lost during the run.
            SessionNotFound: unknown session, or another owner's.
        """
        budget = self.broker.budget(session_id)
        async with budget.run_lock:
            started = time.perf_counter()
            spent = (budget.prompt_tokens, budget.completion_tokens)
            budget.default_model = model
            outcome = "error"
            try:
                answer, iterations, finished = await self._loop(
                    budget, session_id, owner, query, model, gone
                )
                outcome = "ok" if finished else "cut_off"
            finally:
                budget.default_model = None  # the session's own cells get the server's again
                self.broker.observer.rlm_run(outcome)
                log.info(
                    "rlm run session=%s model=%s outcome=%s duration_ms=%.0f",
                    session_id,
                    model or self.broker.config.model,
                    outcome,
                    (time.perf_counter() - started) * 1000,
                )
            self.broker.observer.rlm_turns(iterations)
            return RLMResult(
                answer=answer,
                iterations=iterations,
                finished=finished,
                prompt_tokens=budget.prompt_tokens - spent[0],
                completion_tokens=budget.completion_tokens - spent[1],
            )

    async def _loop(
        self,
        budget: Budget,
        session_id: str,
        owner: str | None,
        query: str,
        model: str | None,
        gone: Callable[[], Awaitable[bool]] | None,
    ) -> tuple[str, int, bool]:
        """(answer, turns taken, whether the model gave FINAL)."""
        info = await self._context_info(session_id, owner)
        if len(query) > _MAX_QUERY_CHARS:
            query = query[:_MAX_QUERY_CHARS] + " [... the query is cut here]"
        messages = [
            {
                "role": "system",
                "content": ROOT_PROMPT.format(context_info=info, output_chars=self.output_chars),
            },
            {"role": "user", "content": FIRST_TURN.format(query=query)},
        ]
        for turn in range(1, self.max_iterations + 1):
            if gone is not None and await gone():
                raise LLMError("the client went away")
            reply = await self.broker.chat(budget, messages, model, kind="root")
            messages.append({"role": "assistant", "content": reply.text})
            blocks = _CODE.findall(reply.text)
            outputs = [await self._run_block(session_id, owner, code) for code in blocks]
            answer, problem = await self._final(session_id, owner, reply.text)
            if answer is not None:
                return answer, turn, True
            if problem is not None:
                outputs.append(problem)
            if outputs:
                rendered = "\n\n".join(
                    f"[block {n}]\n{output}" for n, output in enumerate(outputs, 1)
                )
                messages.append({"role": "user", "content": NEXT_TURN.format(outputs=rendered)})
            else:
                messages.append({"role": "user", "content": NO_CODE_TURN})
        messages.append({"role": "user", "content": LAST_TURN.format(turns=self.max_iterations)})
        reply = await self.broker.chat(budget, messages, model, kind="root")
        answer, _ = await self._final(session_id, owner, reply.text)
        return (answer if answer is not None else reply.text.strip()), self.max_iterations, False

    async def _context_info(self, session_id: str, owner: str | None) -> str:
        """What the root prompt says about `context`: its type and length."""
        code = (
            "[type(context).__name__, len(context) if hasattr(context, '__len__') else None] "
            "if 'context' in globals() else None"
        )
        result = await self._execute(session_id, owner, code)
        value = result.result.get("json") if result.result else None
        if not isinstance(value, list) or len(value) != 2:
            return "no context was given: it is None"
        kind, length = value
        if kind == "str":
            return f"a str of {length} characters"
        if length is None:
            return f"a {kind}"
        return f"a {kind} of {length} items"

    async def _run_block(self, session_id: str, owner: str | None, code: str) -> str:
        return _render(await self._execute(session_id, owner, code), self.output_chars)

    async def _final(
        self, session_id: str, owner: str | None, text: str
    ) -> tuple[str | None, str | None]:
        """(the answer a turn gives with FINAL_VAR or FINAL outside its code, or None;
        why a FINAL_VAR gave none)."""
        prose = _CODE.sub("", text)
        match = _FINAL_VAR.search(prose)
        if match:
            name = match[1]
            result = await self._execute(session_id, owner, f"str({name})[:{_MAX_ANSWER_CHARS}]")
            value = result.result.get("json") if result.result else None
            if isinstance(value, str):
                return value, None
            return None, f"FINAL_VAR({name}) gave no answer:\n{_render(result, 2000)}"
        match = _FINAL.search(prose)
        return (match[1].strip() if match else None), None

    async def _execute(self, session_id: str, owner: str | None, code: str) -> CellResult:
        result = await self.manager.execute(session_id, code, owner=owner)
        if result.status is CellStatus.KILLED:
            raise KernelDied(f"the session was lost during the RLM run: {result.message}")
        return result


def _render(result: CellResult, limit: int) -> str:
    """What a code block printed, its value, and its error, cut to limit characters."""
    parts = [result.output.rstrip("\n")]
    if result.result_text is not None:
        parts.append(result.result_text)
    if result.error is not None:
        lines = result.error["traceback"] or [f"{result.error['ename']}: {result.error['evalue']}"]
        parts.append("\n".join(lines))
    if result.message:
        parts.append(f"[{result.message}]")
    text = "\n".join(part for part in parts if part) or "(no output)"
    if len(text) > limit:
        text = f"{text[:limit]}\n[... {len(text) - limit} more characters cut]"
    return text
