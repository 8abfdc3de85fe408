"""examples/agent_openai.py and examples/data_analysis.py, run as a user would run them, against
the real gVisor server (and, for the agent, a scripted OpenAI-compatible endpoint)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import cloche
from support import REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# What the scripted model does: two tool calls (the second needs the first's variable),
# then an answer built from what the second printed.
TOOL_CALLS = ["answer = 6 * 7", "print('the value is', answer)"]


class ScriptedModel(BaseHTTPRequestHandler):
    """POST /v1/chat/completions: tool calls from TOOL_CALLS, then a final answer."""

    requests: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        tool_results = [m["content"] for m in body["messages"] if m["role"] == "tool"]
        if len(tool_results) < len(TOOL_CALLS):
            code = TOOL_CALLS[len(tool_results)]
            message: dict[str, Any] = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{len(tool_results)}",
                        "type": "function",
                        "function": {"name": "run_python", "arguments": json.dumps({"code": code})},
                    }
                ],
            }
        else:
            message = {"role": "assistant", "content": f"Final: {tool_results[-1]}"}
        answer = json.dumps(
            {
                "id": "scripted",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
        pass


@pytest.fixture
def scripted_model() -> Iterator[str]:
    ScriptedModel.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedModel)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()
    thread.join(10)


def environment(url: str, token: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLOCHE_", "OPENAI_"))}
    return {**env, "CLOCHE_URL": url, "CLOCHE_TOKEN": token, **extra}


def test_the_agent_example_runs_the_models_code_in_one_session(url, token, scripted_model):
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "agent_openai.py"), "What is six times seven?"],
        env=environment(
            url,
            token,
            OPENAI_BASE_URL=scripted_model,
            OPENAI_API_KEY="unused",
            OPENAI_MODEL="scripted",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Final: stdout:\nthe value is 42\n"
    first, second, last = ScriptedModel.requests
    assert first["model"] == "scripted"
    assert first["tools"] == [cloche.tool_schema()]  # what `cloche tool-schema` prints
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    assert last["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": "stdout:\nthe value is 42",
    }
    assert "--- run_python\nanswer = 6 * 7" in done.stderr


def test_the_data_analysis_example_downloads_its_plot(url, token, tmp_path: Path):
    out = tmp_path / "revenue.png"
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "data_analysis.py"), "--out", str(out)],
        env=environment(url, token),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1095 rows, columns: ['date', 'region', 'units', 'revenue']" in done.stdout
    assert "## By month" in done.stdout and "2024-12" in done.stdout
    assert "saved plot.png" in done.stdout and "1 PNG result" in done.stdout
    assert out.read_bytes().startswith(PNG_MAGIC)
