"""A witness session's latency alone and beside a session flooding output and one submitting
cells back to back (`i += 1`, or with `--spin` cells spinning on the CPU for 0.5 s), in
alternating blocks of one run (so the machine's other load weighs on both). The issue's
target: the witness's p99 within 2x of its own baseline.

    sudo .venv/bin/python benchmarks/fairness.py [--blocks 3] [--cells 150] [--spin]
        [serve options]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import BusyClient, ServerProcess, TimedClient, busy  # noqa: E402

FLOOD = "import time\nend = time.time() + 2\nwhile time.time() < end: print('flood' * 16)"
SPIN = "import time\nend = time.time() + 0.5\nwhile time.time() < end: pass"


def quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    server: ServerProcess, blocks: int, cells_per_block: int, spin: bool = False
) -> dict[str, float]:
    witness = TimedClient(server.tcp_port)
    flood = BusyClient(server.tcp_port, FLOOD)
    back_to_back = BusyClient(server.tcp_port, SPIN if spin else "j += 1")
    witness.cells(30)  # warm
    alone: list[float] = []
    beside: list[float] = []
    ratios = []
    for _ in range(blocks):
        alone_block = witness.cells(cells_per_block)
        with busy(flood, back_to_back):
            beside_block = witness.cells(cells_per_block)
        ratios.append(quantile(beside_block, 0.99) / quantile(alone_block, 0.99))
        alone += alone_block
        beside += beside_block
    for client in (witness, flood, back_to_back):
        client.close()
    figures = {
        "alone_p50_ms": statistics.median(alone) * 1e3,
        "alone_p90_ms": quantile(alone, 0.90) * 1e3,
        "alone_p99_ms": quantile(alone, 0.99) * 1e3,
        "beside_p50_ms": statistics.median(beside) * 1e3,
        "beside_p90_ms": quantile(beside, 0.90) * 1e3,
        "beside_p99_ms": quantile(beside, 0.99) * 1e3,
        "load_average_1min": os.getloadavg()[0],
    }
    figures["p50_ratio"] = figures["beside_p50_ms"] / figures["alone_p50_ms"]
    figures["p99_ratio"] = figures["beside_p99_ms"] / figures["alone_p99_ms"]
    figures["p99_ratio_median_of_blocks"] = statistics.median(ratios)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--cells", type=int, default=150, help="witness cells per block")
    parser.add_argument("--spin", action="store_true", help="the second session spins")
    args, serve_args = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="cloche-fairness-") as scratch:
        server = ServerProcess(
            Path(scratch) / "state", "--pool-size", "3", "--data-pool-size", "0", *serve_args
        )
        try:
            figures = measure(server, args.blocks, args.cells, args.spin)
        finally:
            server.stop()
    print(json.dumps({k: round(v, 2) for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
