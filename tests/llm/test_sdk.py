"""session.rlm() and set_context() in the SDK, and `cloche rlm`, against the stub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cloche
from cloche.errors import LLMError, LLMUnavailable
from llm.stub import StubError, StubLLM
from llm.test_rlm import NEEDLE, haystack, script
from support import ServerThread


def url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def test_session_rlm_answers_from_a_context(llm_server, stub: StubLLM):
    stub.reset(script)
    with cloche.Client(url(llm_server)) as client, client.create_session() as session:
        assert session.rlm("What is the magic number?", context=haystack(1_500_000)) == NEEDLE
        assert session.run("answer").result_json == NEEDLE  # the run's variables stay


def test_set_context_streams_a_file_and_guesses_json(llm_server, tmp_path: Path):
    path = tmp_path / "docs.json"
    path.write_text(json.dumps({"docs": list(range(100_000))}))
    with cloche.Client(url(llm_server)) as client, client.create_session() as session:
        assert session.set_context(path) == path.stat().st_size
        assert session.run("len(context['docs'])").result_json == 100_000
        session.set_context("plain")
        assert session.run("context").result_json == "plain"


def test_llm_failures_raise_the_trees_llm_errors(llm_server, server, stub: StubLLM):
    def down(body: dict[str, object]) -> str:
        raise StubError(500, "down")

    stub.reset(down)
    with cloche.Client(url(llm_server)) as client, client.create_session() as session:
        with pytest.raises(LLMError, match="answered 500: down"):
            session.rlm("?")
    with cloche.Client(url(server)) as client, client.create_session() as session:
        with pytest.raises(LLMUnavailable, match="--llm-base-url"):
            session.rlm("?")


def test_the_cli_answers_a_question_about_a_file(llm_server, stub: StubLLM, tmp_path: Path):
    stub.reset(script)
    sessions_before = llm_server.server.manager.session_count
    context = tmp_path / "haystack.txt"
    context.write_text(haystack(1_000_000, seed=3))
    done = subprocess.run(
        [sys.executable, "-m", "cloche.cli", "rlm", "What is the magic number?"]
        + ["--context", str(context), "--url", url(llm_server)],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("CLOCHE_")},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{NEEDLE}\n"
    assert llm_server.server.manager.session_count == sessions_before  # closed (no --keep)
