"""benchmarks/bench_ports.py without a server: its arguments, and its table's figures held
to their targets against the baselines of the same run."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("bench_ports")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_arguments_default_to_the_issues_run_and_refuse_nothing_to_measure(bench, capsys):
    args = bench.parse([])
    assert (args.requests, args.mib, args.rounds, args.sessions, args.seconds) == (
        500,
        100,
        3,
        50,
        10.0,
    )
    assert bench.parse(["--sessions", "2", "--mib", "1"]).sessions == 2
    for wrong in (["--rounds", "0"], ["--sessions", "0"], ["--mib", "x"]):
        with pytest.raises(SystemExit):
            bench.parse(wrong)
    assert "--rounds is at least 1" in capsys.readouterr().err


def _trace(rate_mib_s: float) -> list[list[float]]:
    """A download's trace: (time, MiB so far), its first byte at 0.1 s."""
    return [[0.0, 0.0], *([0.1 + t, rate_mib_s * t] for t in (0.0, 1.0, 2.0, 3.0))]


def results(added_ms: float, port_mib_s: float, rates: list[float]) -> dict[str, Any]:
    def latencies(p50: float) -> list[float]:
        return [p50] * 99 + [p50 * 3]

    latency = {
        "port": latencies(0.5 + added_ms),
        "host": latencies(0.5),
        "no listener": latencies(3.0),
        "relay": latencies(0.8),
        "raw host": latencies(0.1),
        "door": latencies(0.2),
        "in sandbox": latencies(0.4),
    }
    mib_s = {"port": [port_mib_s] * 3, "host": [400.0, 420.0, 380.0], "relay": [450.0] * 3}
    mib_s |= {"raw host": [1700.0] * 3, "door": [1500.0] * 3, "in sandbox": [900.0] * 3}
    cpu = {"client": 0.3, "front end": 0.2, "sandbox": 0.1, "host app": 0.0}
    return {
        "args": {"requests": 99, "mib": 100, "rounds": 3, "sessions": len(rates), "seconds": 5},
        "command": "bench_ports.py",
        "started_utc": "2026-12-06 09:00 UTC",
        "load_start": (20.0, 18.0, 15.0),
        "load_end": (22.0, 19.0, 16.0),
        "latency_ms": latency,
        "mib_s": mib_s,
        "many": [_trace(rate) for rate in rates],
        "cpu_s": {
            "client start": {"client": 0.25, "front end": 0, "sandbox": 0, "host app": 0},
            **{name: dict(cpu) for name in ("port requests", "host requests")},
            **{name: dict(cpu) for name in ("port downloads", "host downloads")},
        },
    }


def _verdicts(table: str) -> dict[str, str]:
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")]
    return {row[0].lstrip("| "): row[-1].rstrip(" |") for row in rows if row[-1].strip(" |")}


def test_each_figure_is_held_to_its_target_against_the_same_runs_baseline(bench):
    met = bench.report(results(0.9, 210.0, [10.0, 12.0, 19.0]))
    verdicts = _verdicts(met)
    assert list(verdicts.values()) == ["verdict", "**met**", "**met**", "**met**", "**met**"]
    assert "added 0.900 ms" in met
    assert "210 / 400 (0.53)" in met  # the medians, and their ratio
    assert "slowest 10.0, fastest 19.0 MiB/s (1.90x)" in met
    assert "load average 20.0 at the start, 22.0 at the end" in met
    missed = _verdicts(bench.report(results(1.1, 190.0, [10.0, 21.0])))
    assert list(missed.values()) == ["verdict", "missed", "**met**", "missed", "missed"]


def test_the_cpu_each_part_used_leaves_out_the_clients_start(bench):
    table = bench.report(results(0.9, 210.0, [10.0, 12.0]))
    # (0.3 - 0.25) s of the client over 100 requests; 0.2 s of the front end
    assert "- per request through the port: client 0.50, front end 2.00, sandbox 1.00 ms" in table
    # 300 MiB in all: the client's start taken out three times (0.3 - 3 x 0.25 < 0: none)
    assert "- per GiB through the port: front end 0.68, sandbox 0.34 s" in table
