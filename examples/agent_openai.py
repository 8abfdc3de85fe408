"""An agent loop: a model answers a question by running Python in a cloche session.

    cloche serve &                                   # or ./run.sh, on a machine with runsc
    OPENAI_API_KEY=sk-... OPENAI_MODEL=gpt-4.1-mini \\
        python examples/agent_openai.py "What is the 300th prime, and the sum of those before?"

Any OpenAI-compatible endpoint works: set OPENAI_BASE_URL too (vLLM, Ollama, llama.cpp, a
hosted API). The model gets one tool, `run_python`, defined by `cloche.tool_schema()` (what
`cloche tool-schema` prints); every call it makes runs in the same session, so variables,
imports and files carry over, as in a notebook. CLOCHE_URL and CLOCHE_TOKEN say where the
cloche server is (default http://127.0.0.1:8080). The code the model runs and what it printed
go to stderr; the final answer to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import openai

import cloche

SYSTEM = (
    "You answer questions by computing, not guessing: call run_python to run Python code "
    "(state persists between calls) and base your answer on what it prints. Keep the final "
    "answer short."
)


def run_tool_call(session: cloche.Session, name: str, arguments: str) -> str:
    """What the model's tool call gives back: the cell's outcome as text."""
    if name != "run_python":
        return f"error: there is no tool named {name!r}; use run_python"
    try:
        code = json.loads(arguments)["code"]
    except (ValueError, KeyError, TypeError):
        return 'error: the arguments must be JSON like {"code": "print(1)"}'
    print(f"--- run_python\n{code}", file=sys.stderr)
    execution = session.run(code)  # an exception in the code is data: the model reads it
    output = execution.to_text()
    print(f"--- output\n{output}", file=sys.stderr)
    return output


def agent(question: str, *, model: str, profile: str, max_turns: int) -> str | None:
    """The model's final answer, or None when it did not give one within max_turns."""
    llm = openai.OpenAI()  # OPENAI_API_KEY and OPENAI_BASE_URL come from the environment
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    with cloche.Client() as client, client.create_session(profile) as session:
        for _ in range(max_turns):
            reply = llm.chat.completions.create(
                model=model, messages=messages, tools=[cloche.tool_schema()]
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content or ""
            for call in message.tool_calls:
                if call.type != "function":
                    continue
                output = run_tool_call(session, call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "question",
        nargs="?",
        default="How many Sundays fell on the first of a month in the 20th century?",
    )
    parser.add_argument("--profile", choices=("lean", "data"), default="lean")
    parser.add_argument("--max-turns", type=int, default=8)
    args = parser.parse_args()
    model = os.environ.get("OPENAI_MODEL", "gpt-4.1-mini")
    answer = agent(args.question, model=model, profile=args.profile, max_turns=args.max_turns)
    if answer is None:
        print(f"no answer within {args.max_turns} turns", file=sys.stderr)
        return 1
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
