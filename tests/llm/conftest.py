"""Fixtures of the LLM tests: a stub endpoint, and gVisor servers that use it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from cloche.config import Limits, LLMConfig
from llm.stub import StubLLM
from support import CANARY, ServerThread, make_config, require_gvisor

KEY = "sk-" + CANARY  # the API key: a canary that must never appear inside a sandbox


@pytest.fixture(scope="module")
def stub() -> Iterator[StubLLM]:
    with StubLLM() as running:
        yield running


@pytest.fixture(autouse=True)
def _fresh_stub(request: pytest.FixtureRequest) -> None:
    if "stub" in request.fixturenames:
        request.getfixturevalue("stub").reset()


def llm_config(stub: StubLLM, **overrides: object) -> LLMConfig:
    config = LLMConfig(base_url=stub.url, model="stub-model", api_key=KEY, max_retries=0)
    return replace(config, **overrides)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm_server(state_root: Path, stub: StubLLM) -> Iterator[ServerThread]:
    """A gVisor server whose sessions reach the stub through llm_query."""
    require_gvisor()
    # 120 s cells: the isolation search walks the sandbox's files and /proc, which took
    # over 20 s on two cores at a load of 18.
    limits = Limits(cell_timeout_s=120.0, interrupt_grace_s=1.0)
    config = make_config(state_root, llm=llm_config(stub), limits=limits)
    with ServerThread(config) as running:
        yield running


@pytest.fixture
def make_llm_server(state_root: Path, stub: StubLLM) -> Iterator[Callable[..., ServerThread]]:
    """make_llm_server(limits=..., max_calls=...): a server with its own LLM settings."""
    require_gvisor()
    started: list[ServerThread] = []

    def make(limits: Limits | None = None, **llm: object) -> ServerThread:
        overrides: dict[str, object] = {"llm": llm_config(stub, **llm), "pool_size": 1}
        if limits is not None:
            overrides["limits"] = limits
        running = ServerThread(make_config(state_root, **overrides)).__enter__()
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()
