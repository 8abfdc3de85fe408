"""A session's cell history (sessions/history.py): its bounds, and what keeping a cell costs."""

from __future__ import annotations

import json

import pytest

from cloche.sessions import history
from cloche.sessions.history import CellEntry, History


def entry(number: int, stdout: str = "") -> CellEntry:
    return CellEntry(
        number=number,
        execution_count=number,
        code="1+1",
        status="ok",
        end_reason="ok",
        started_at=1.0,
        ended_at=1.001,
        duration_s=0.001,
        stdout=stdout,
        stderr="",
        result={"text/plain": "2"},
        front_end="tcp",
    )


def test_keeping_a_cell_measures_it_once_without_copying_it(monkeypatch):
    """On every cell: a full history measured the new entry and the one it let go, each as
    a deep copy (dataclasses.asdict) then JSON, 51 us of the server's CPU per warm cell."""
    measured = []
    dumps = json.dumps

    def counting(value, **options):
        measured.append(value["number"])
        return dumps(value, **options)

    def copied(self):
        raise AssertionError("an entry was copied to be measured")

    kept = History(200)
    monkeypatch.setattr(history.json, "dumps", counting)
    monkeypatch.setattr(CellEntry, "to_json", copied)
    for number in range(1, 301):
        kept.add(entry(number))
    assert measured == list(range(1, 301))  # each once, as it came
    assert [e.number for e in kept.after()] == list(range(101, 301))


def test_the_oldest_cells_go_once_the_history_holds_too_many_bytes(monkeypatch):
    one = entry(1, stdout="x" * 1000).size
    monkeypatch.setattr(history, "HISTORY_MAX_BYTES", 3 * one)
    kept = History(200)
    for number in range(1, 6):
        kept.add(entry(number, stdout="x" * 1000))
    assert [e.number for e in kept.after()] == [3, 4, 5]
    assert one == len(json.dumps(entry(1, stdout="x" * 1000).to_json()))


@pytest.mark.parametrize("cells", [0, 1, 3])
def test_the_history_keeps_its_last_cells(cells):
    kept = History(cells)
    for number in range(1, 6):
        kept.add(entry(number))
    assert [e.number for e in kept.after()] == list(range(6 - cells, 6))
    assert kept.next_number() == 6
