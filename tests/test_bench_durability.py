"""benchmarks/bench_durability.py without a server: its arguments, verdicts and tables."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("bench_durability")
    finally:
        sys.path.remove(str(BENCHMARKS))


def lean_run(bench: ModuleType) -> object:
    run = bench.ProfileRun("lean")
    for what, ms in {
        "warm cell (baseline)": 3.0,
        "pause": 150.0,
        "resume on first cell": 500.0,
        "fork of 1: response": 400.0,
        "fork of 10: response": 2200.0,
    }.items():
        for _ in range(3):
            run.add(what, ms)
    run.snapshot_size_bytes = run.snapshot_disk_bytes = run.paused_disk_bytes = [2 * 1024**2]
    return run


def test_defaults_are_the_issues_sizes(bench):
    args = bench.parse([])
    assert (args.lean, args.data, args.restart, args.page_out, args.wake) == (10, 3, 100, 300, 20)
    assert args.parts == {"latency", "restart", "pageout"}


def test_unknown_parts_and_empty_runs_are_refused(bench, capsys):
    for argv in (["--parts", "latency,nap"], ["--restart", "0"], ["--lean", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse(argv)
    assert "--parts" in capsys.readouterr().err


def test_verdicts_say_met_or_missed_with_the_ratio(bench):
    rows = {row[0]: row for row in bench.verdicts([lean_run(bench)], None, None, 10 * 1024**3)}
    assert rows["lean pause p50 <= 300 ms"][2] == "met (0.50x the target)"
    assert rows["lean resume on first cell p50 <= 400 ms"][2] == (
        "MISSED: 1.25x the target (100 ms over)"
    )
    # 9 more copies in 1.8 s: 5 copies/s, just met.
    assert rows["lean fork, >= 5 copies/s after the first"][2] == "met (1.00x the target)"


def test_page_out_projects_2000_sessions_from_ram_and_disk_per_session(bench):
    paged = bench.PageOutRun(300, mem_available_before_kib=3_000_000)
    paged.mem_available_after_kib = 3_000_000 - 300 * 1024  # 1 MiB each
    paged.disk_bytes = 300 * 2 * 1024**2
    (row,) = bench.verdicts([], None, paged, 78 * 1024**3)
    assert row[2].startswith("met (projected from 300;")
    assert paged.held_per_gib == 1024


def test_tables_render_as_text_and_markdown(bench):
    runs = [lean_run(bench)]
    verdicts = bench.verdicts(runs, None, None, 1)
    rows = bench.measurement_rows(runs, None, None)
    markdown = bench.render(verdicts, rows, ["a note"], markdown=True)
    assert "| lean: pause " in markdown and "|---" in markdown and "- a note" in markdown
    text = bench.render(verdicts, rows, ["a note"], markdown=False)
    assert "lean: fork of 10: copies/s" in text and "|" not in text
