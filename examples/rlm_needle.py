"""Find a needle in a large generated haystack with a Recursive Language Model.

    CLOCHE_LLM_BASE_URL=https://api.openai.com/v1 CLOCHE_LLM_MODEL=gpt-4.1-mini \\
    CLOCHE_LLM_API_KEY=sk-... sudo -E .venv/bin/python examples/rlm_needle.py --mb 8

Any OpenAI-compatible endpoint works (vLLM, Ollama, llama.cpp, a hosted API). The example
starts a cloche server in this process (as root, with runsc installed) whose sessions reach
that endpoint through `llm_query`; or, with CLOCHE_URL set, it uses a running server that
was started with --llm-base-url and --llm-model. The haystack is streamed into a session as
its `context` (PUT /v1/sessions/{id}/context), then the RLM is asked through the `openai`
client (POST /v1/chat/completions, model "rlm:<model>"): the root model never sees the
haystack, only what its code prints. Exits 0 when the RLM found the number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai

from cloche.config import MIB, Limits, LLMConfig, ServerConfig, default_state_dir
from cloche.server.app import Server

WORDS = (
    "river stone lantern orchard velvet harbor meadow copper signal thistle ember quarry "
    "saddle willow mirror canyon parcel beacon hollow juniper"
).split()


def haystack(size_bytes: int, needle: int, seed: int) -> str:
    """Random sentences, with one that states the needle, somewhere."""
    rng = random.Random(seed)  # noqa: S311  # a reproducible haystack, not a secret
    lines = []
    total = 0
    while total < size_bytes:
        line = " ".join(rng.choices(WORDS, k=rng.randint(8, 16))).capitalize() + "."
        lines.append(line)
        total += len(line) + 1
    lines.insert(rng.randrange(len(lines)), f"The secret access code is {needle}.")
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def cloche_url(state_dir: Path) -> AsyncIterator[str]:
    """The URL of a cloche server: CLOCHE_URL, or one started here."""
    if os.environ.get("CLOCHE_URL"):
        yield os.environ["CLOCHE_URL"].rstrip("/")
        return
    base_url, model = os.environ.get("CLOCHE_LLM_BASE_URL"), os.environ.get("CLOCHE_LLM_MODEL")
    if not base_url or not model:
        sys.exit("set CLOCHE_LLM_BASE_URL and CLOCHE_LLM_MODEL (and CLOCHE_LLM_API_KEY)")
    config = ServerConfig(
        tcp_port=0,
        http_port=0,
        pool_size=1,
        data_pool_size=0,
        state_dir=state_dir,
        limits=Limits(cell_timeout_s=120.0),
        llm=LLMConfig(
            base_url=base_url, model=model, api_key=os.environ.get("CLOCHE_LLM_API_KEY", "")
        ),
    )
    server = Server(config)
    await server.start()
    try:
        assert server.http is not None
        yield f"http://127.0.0.1:{server.http.port}"
    finally:
        await server.stop()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=8.0, help="size of the haystack, MiB")
    parser.add_argument("--seed", type=int, default=2025)
    parser.add_argument("--state-dir", type=Path, default=default_state_dir())
    args = parser.parse_args()

    needle = random.Random(args.seed).randrange(10**6, 10**7)  # noqa: S311
    context = haystack(int(args.mb * MIB), needle, args.seed)
    print(f"haystack: {len(context):,} characters; the needle is {needle}")
    async with cloche_url(args.state_dir) as url, httpx.AsyncClient(timeout=600) as http:
        session = (await http.post(f"{url}/v1/sessions")).raise_for_status().json()["id"]
        try:
            put = await http.put(f"{url}/v1/sessions/{session}/context", content=context.encode())
            print("context:", put.raise_for_status().json())
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=1800)
            started = time.perf_counter()
            completion = await client.chat.completions.create(
                model="rlm:",  # the server's --llm-model, for the root and for llm_query
                messages=[{"role": "user", "content": "What is the secret access code?"}],
                extra_headers={"x-cloche-session-id": session},
            )
            await client.close()
        finally:
            await http.delete(f"{url}/v1/sessions/{session}")
    answer = completion.choices[0].message.content or ""
    print(f"answer ({time.perf_counter() - started:.1f} s): {answer}")
    print("usage:", completion.usage)
    found = str(needle) in answer
    print("found the needle" if found else "missed the needle")
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
