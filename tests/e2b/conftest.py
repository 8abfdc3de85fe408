"""A gVisor server for the E2B SDKs, which reach it by E2B_API_URL and E2B_SANDBOX_URL."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloche.config import Limits
from support import E2B_KEY as KEY
from support import E2B_OTHER as OTHER
from support import ServerThread, make_config, require_gvisor


@pytest.fixture(scope="module")
def server(state_root: Path) -> Iterator[ServerThread]:
    require_gvisor()
    # Cells import matplotlib and pandas on a loaded machine: a cell timeout to match.
    limits = Limits(cell_timeout_s=180.0, interrupt_grace_s=2.0)
    config = make_config(state_root, tokens=frozenset({KEY, OTHER}), limits=limits)
    with ServerThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def e2b_env(server: ServerThread) -> Iterator[dict[str, str]]:
    """The two variables (and the key) that point unmodified E2B code at cloche."""
    url = f"http://127.0.0.1:{server.http_port}/e2b"
    env = {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": KEY}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    yield env
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
