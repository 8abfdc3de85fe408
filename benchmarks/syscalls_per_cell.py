"""System calls per cell inside the sandbox: one kernel under `runsc --strace`, driven over
its pipes with `i += 1` cells; the syscalls the sentry logged between two marks, divided by
the cells.

    sudo .venv/bin/python benchmarks/syscalls_per_cell.py [--cells 200]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from cloche.config import Limits, ServerConfig
from cloche.protocol.framing import FrameDecoder, decode_body, encode_frame
from cloche.sandbox.gvisor import GVisorBackend, GVisorSandbox
from cloche.sandbox.runsc import Runsc
from floor import WARMUP_S

SYSCALL = re.compile(r"\] \[\s*\d+:\s*\d+\] \S+ E (\w+)\(")


class TracingRunsc(Runsc):
    """runsc with every syscall of the sandbox logged to debug_dir."""

    debug_dir = Path("/nonexistent")

    def global_args(self, platform: str | None = None) -> list[str]:
        return [*super().global_args(platform), "--strace", f"--debug-log={self.debug_dir}/"]


class Kernel:
    """A kernel's channel: send a cell, read frames until its end."""

    def __init__(self, sandbox: GVisorSandbox) -> None:
        self.sandbox = sandbox
        self.decoder = FrameDecoder(16 << 20)
        self.pending: list[dict[str, Any]] = []

    def next_message(self, timeout_s: float = 60.0) -> dict[str, Any]:
        while not self.pending:
            ready, _, _ = select.select([self.sandbox.stdout], [], [], timeout_s)
            if not ready:
                raise RuntimeError("the kernel did not answer")
            data = os.read(self.sandbox.stdout.fileno(), 65536)
            if not data:
                raise RuntimeError("the kernel exited: " + self.sandbox.startup_log())
            self.pending += [decode_body(body) for body in self.decoder.feed(data)]
        return self.pending.pop(0)

    def run(self, code: str) -> None:
        os.write(self.sandbox.stdin.fileno(), encode_frame({"op": "exec", "code": code}))
        while (message := self.next_message())["op"] != "done":
            pass
        if message["status"] != "ok":
            raise RuntimeError(f"the cell failed: {message}")


def logged_syscalls(debug_dir: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for path in debug_dir.glob("*boot*"):
        with path.open(errors="replace") as log:
            for line in log:
                match = SYSCALL.search(line)
                if match:
                    counts[match[1]] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--platform", default="auto")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cloche-strace-") as scratch:
        config = ServerConfig(
            backend="gvisor", state_dir=Path(scratch) / "state", platform=args.platform
        )
        backend = GVisorBackend(config)
        backend.prepare()
        assert backend.runsc is not None
        tracing = TracingRunsc(backend.runsc.binary, backend.runsc.root, backend.runsc.platform)
        tracing.debug_dir = Path(scratch) / "debug"
        tracing.debug_dir.mkdir()
        backend.runsc = tracing
        sandbox = backend.create(Limits())
        try:
            sandbox.launch()
            kernel = Kernel(sandbox)
            assert kernel.next_message()["op"] == "ready"
            kernel.run("i = 0")
            until = time.monotonic() + 3 * WARMUP_S  # until clock_gettime stops trapping (vDSO)
            while time.monotonic() < until:
                kernel.run("i += 1")
            before = logged_syscalls(tracing.debug_dir)
            for _ in range(args.cells):
                kernel.run("i += 1")
            after = logged_syscalls(tracing.debug_dir)
        finally:
            sandbox.close(grace_s=5.0)
            backend.shutdown()
    per_cell = {name: (after[name] - before[name]) / args.cells for name in after}
    per_cell = {k: round(v, 2) for k, v in sorted(per_cell.items(), key=lambda kv: -kv[1]) if v}
    print(
        json.dumps(
            {
                "platform": tracing.platform,
                "cells": args.cells,
                "syscalls_per_cell": round(sum(per_cell.values()), 2),
                "by_name": per_cell,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
