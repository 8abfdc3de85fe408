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
    a deep copy (dataclasses.asdict) then JSON, 51 us of the server's CPU per warm cell;
    then as JSON whole, 7 us. Now by its texts' lengths, once, without JSON for text."""
    weighed = []
    weight = history._weight

    def counting(part):  # type: ignore[no-untyped-def]
        weighed.append(part)
        return weight(part)

    def copied(self):
        raise AssertionError("an entry was copied to be measured")

    kept = History(200)
    monkeypatch.setattr(history, "_weight", counting)
    monkeypatch.setattr(CellEntry, "to_json", copied)
    monkeypatch.setattr(history.json, "dumps", lambda *_, **__: pytest.fail("JSON made"))
    for number in range(1, 301):
        kept.add(entry(number))
    assert weighed == [{"text/plain": "2"}, None] * 300  # result and error, each entry once
    assert [e.number for e in kept.after()] == list(range(101, 301))


def test_the_oldest_cells_go_once_the_history_holds_too_many_bytes(monkeypatch):
    one = entry(1, stdout="x" * 1000).size
    monkeypatch.setattr(history, "HISTORY_MAX_BYTES", 3 * one)
    kept = History(200)
    for number in range(1, 6):
        kept.add(entry(number, stdout="x" * 1000))
    assert [e.number for e in kept.after()] == [3, 4, 5]
    as_json = len(json.dumps(entry(1, stdout="x" * 1000).to_json()))
    assert as_json * 0.8 < one < as_json * 1.25  # about its JSON's length


@pytest.mark.parametrize("cells", [0, 1, 3])
def test_the_history_keeps_its_last_cells(cells):
    kept = History(cells)
    for number in range(1, 6):
        kept.add(entry(number))
    assert [e.number for e in kept.after()] == list(range(6 - cells, 6))
    assert kept.next_number() == 6
