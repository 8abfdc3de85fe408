"""benchmarks/cpu_per_cell.py without a server: it finds every process a sandbox runs."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

# A chain of processes, each the parent of the next, the last of which says "ready" and
# waits for its stdin to close (the same shape as a ptrace sentry, its first stub, and the
# stubs that stub forks).
CHAIN = (
    "import subprocess, sys\n"
    "depth = int(sys.argv[1])\n"
    "if depth:\n"
    "    subprocess.run([sys.executable, '-c', sys.argv[2], str(depth - 1), sys.argv[2]])\n"
    "else:\n"
    "    print('ready', flush=True)\n"
    "    sys.stdin.read()\n"
)


@pytest.fixture(scope="module")
def cpu() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("cpu_per_cell")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_grandchildren_are_counted(cpu):
    with subprocess.Popen(
        [sys.executable, "-c", CHAIN, "2", CHAIN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as root:
        assert root.stdin is not None and root.stdout is not None
        try:
            assert root.stdout.readline() == "ready\n"
            found = cpu.with_children([root.pid])
        finally:
            root.stdin.close()
        assert root.wait(timeout=60) == 0
    assert root.pid in found
    assert len(found) == 3
