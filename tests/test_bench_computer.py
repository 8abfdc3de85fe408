"""benchmarks/bench_computer.py without a server: its arguments, verdicts and tables."""

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
        return importlib.import_module("bench_computer")
    finally:
        sys.path.remove(str(BENCHMARKS))


def samples(bench: ModuleType) -> object:
    run = bench.Samples()
    for what, values in {
        "new session (lean) from its pool": [4.0, 4.2, 3.8],
        "new session (template debian) from its pool": [4.4, 4.6, 4.5],
        "cell `1+1`": [1.0, 1.2, 0.8],
        "command `true` (bash -lc)": [30.0, 31.0, 29.0],
        "command /bin/true, args (no shell)": [1.9, 2.1, 1.8],
        "keystroke echo through the terminal (websocket)": [2.5, 2.4, 2.6],
        "pause (empty layer)": [100.0, 110.0, 90.0],
        "pause (100 MiB layer)": [300.0, 330.0, 270.0],
    }.items():
        for value in values:
            run.add(what, value)
    return run


def test_quick_is_a_smoke_run_and_parts_are_checked(bench, capsys):
    full, quick = bench.parse([]), bench.parse(["--quick"])
    assert (full.sessions, full.commands, full.rounds, full.keys) == (20, 200, 5, 200)
    assert quick.sessions < full.sessions and quick.keys < full.keys
    assert quick.parts == set(bench.PARTS)
    with pytest.raises(SystemExit):
        bench.parse(["--parts", "sessions,naps"])
    assert "--parts" in capsys.readouterr().err


def test_verdicts_hold_each_figure_to_its_target(bench):
    rows = {row[0]: row for row in bench.verdicts(samples(bench))}
    assert rows["new template session from the pool p50 <= 5 ms"][1:] == ["4.5 ms", "met"]
    shell = rows["command `true` p50 <= 2x a cell's (same session)"]
    assert shell[1] == "30.0x (30 / 1 ms)" and shell[2] == "MISSED (15.0x the target)"
    assert rows["command /bin/true (args, no shell) p50 <= 2x a cell's"][2] == "met"
    assert rows["terminal keystroke echo p50 <= 2 ms"][2] == "MISSED (1.2x the target)"


def test_rows_give_each_figure_against_its_baseline_of_the_same_run(bench):
    rows = {row[0]: row for row in bench.measurement_rows(samples(bench))}
    assert rows["new session (template debian) from its pool"][5] == "1.12x"
    assert rows["pause (100 MiB layer)"][5] == "3.00x"
    assert rows["cell `1+1`"][5] == "-"
    markdown = bench.render(samples(bench), ["a note"], markdown=True)
    assert "| pause (100 MiB layer) | 3 | 300 |" in markdown and "- a note" in markdown
    assert "|" not in bench.render(samples(bench), ["a note"], markdown=False)
