"""One run of the suite: every figure it measures (`Run`), the warm pools of its main
server, and its log lines.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

POOL, DATA_POOL = 4, 1  # the warm pools of the main server


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Run:
    """Every figure of one run: samples in their units, and scalar results."""

    latency_us: dict[str, list[float]] = field(default_factory=dict)
    samples_ms: dict[str, list[float]] = field(default_factory=dict)
    throughput: list[dict[str, Any]] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
