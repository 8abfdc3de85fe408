"""examples/rlm_needle.py, run as a user would, with the stub as its endpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from llm.stub import StubLLM
from support import REPO, require_gvisor

ROOT_CODE = """```repl
pieces = [context[i:i + 300_000] for i in range(0, len(context), 300_000)]
answers = llm_query_batched(["Find the secret access code, or say none.\\n" + p for p in pieces])
code = next((a for a in answers if a != "none"), "not found")
print(len(pieces), code)
```"""


def script(body: dict[str, Any]) -> str:
    messages = body["messages"]
    if messages[0]["role"] == "system":
        return ROOT_CODE if len(messages) == 2 else "FINAL_VAR(code)"
    found = re.search(r"secret access code is (\d+)", messages[-1]["content"])
    return found[1] if found else "none"


def test_the_needle_example_finds_its_needle(stub: StubLLM, tmp_path: Path):
    require_gvisor()
    stub.reset(script)
    env = {
        **os.environ,
        "CLOCHE_LLM_BASE_URL": stub.url,
        "CLOCHE_LLM_MODEL": "stub-model",
        "CLOCHE_LLM_API_KEY": "unused",
    }
    env.pop("CLOCHE_URL", None)
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "rlm_needle.py"), "--mb", "3"]
        + ["--state-dir", str(tmp_path / "state")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "found the needle" in done.stdout
    assert sum(not r.is_root for r in stub.requests) == 11  # 3 MiB in 300 kB pieces
