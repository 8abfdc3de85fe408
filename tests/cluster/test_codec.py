"""What crosses the data path comes back as it left."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cloche import errors
from cloche.cluster import codec
from cloche.sandbox.listing import FileInfo, FileListing
from cloche.sessions.result import CellResult, CellStatus
from cloche.sessions.session import SessionInfo, SessionState
from cloche.sessions.store import SnapshotRecord


def crossed(value: object) -> object:
    return json.loads(json.dumps(value))


@given(
    status=st.sampled_from(CellStatus),
    streams=st.lists(st.tuples(st.sampled_from(["stdout", "stderr"]), st.text())),
    files=st.lists(st.text()),
)
def test_a_cell_result_survives_the_trip(status, streams, files) -> None:
    result = CellResult(
        status=status,
        streams=streams,
        result={"data": {"text/plain": "42"}, "json": 42},
        error={"ename": "E", "evalue": "v", "traceback": ["t"]},
        execution_count=3,
        duration_ms=1.5,
        files=files,
    )
    assert codec.result_in(crossed(codec.result_out(result))) == result  # type: ignore[arg-type]


def test_session_info_snapshot_and_listing_survive_the_trip() -> None:
    info = SessionInfo("a" * 32, "k", SessionState.PAUSED, 1.0, 2.0, 3, 0, "data")
    assert codec.info_in(crossed(codec.info_out(info))) == info  # type: ignore[arg-type]
    record = SnapshotRecord("s", "a", "n", None, "lean", 1.0, 2, 10, "runsc x")
    assert codec.snapshot_in(crossed(codec.snapshot_out(record))) == record  # type: ignore[arg-type]
    listing = FileListing((FileInfo("a/b.txt", 3, 1.5),), truncated=True)
    assert codec.listing_in(crossed(codec.listing_out(listing))) == listing  # type: ignore[arg-type]


@given(st.binary())
def test_bytes_survive_the_trip(data: bytes) -> None:
    assert codec.bytes_in(codec.bytes_out(data)) == data


@pytest.mark.parametrize(
    "exc",
    [
        errors.SessionNotFound("abc"),
        errors.SessionMoved("abc"),
        errors.SnapshotNotFound("snap"),
        errors.PathRefused("x/y", "it is a FIFO"),
        errors.PathNotFound("x/y"),
        errors.TooManySessions("at --max-sessions"),
        errors.StorageFull("full"),
        errors.PackageInstallError("no wheel"),
        errors.SessionBusy("16 cells wait"),
    ],
)
def test_errors_come_back_as_the_same_class_and_message(exc: errors.ClocheError) -> None:
    back = codec.error_in(crossed(codec.error_out(exc)))  # type: ignore[arg-type]
    assert type(back) is type(exc)
    assert str(back) == str(exc)


def test_an_unknown_error_type_becomes_a_cloche_error_not_anything_else() -> None:
    back = codec.error_in({"type": "SystemExit", "message": "no"})
    assert type(back) is errors.ClocheError
    back = codec.error_in({"type": "__import__", "message": "no"})
    assert type(back) is errors.ClocheError
