"""The data directory: root-only, one server at a time, records written whole."""

from __future__ import annotations

import pytest

from cloche.errors import ConfigError, StorageFull
from cloche.sessions.store import RecordState, SessionRecord, Store


def record(**changes: object) -> SessionRecord:
    fields: dict[str, object] = dict(
        id="a" * 32,
        owner_key=None,
        profile="lean",
        created_at=1.0,
        last_active=2.0,
        execution_count=3,
        state=RecordState.PAUSED,
        origin="gvisor",
    )
    fields.update(changes)
    return SessionRecord(**fields)  # type: ignore[arg-type]


def test_records_are_root_only_and_read_back(tmp_path):
    store = Store(tmp_path / "data", budget_bytes=10**9)
    store.open()
    try:
        store.save(record())
        assert store.session_records() == [record()]
        assert (tmp_path / "data").stat().st_mode & 0o777 == 0o700
        home = store.session_dir("a" * 32)
        assert home.stat().st_mode & 0o777 == 0o700
        assert (home / "record.json").stat().st_mode & 0o777 == 0o600
        store.save(record(state=RecordState.LOST))
        assert store.session_record("a" * 32).state is RecordState.LOST
        assert not list(home.glob("*.new"))
    finally:
        store.close()


def test_a_damaged_record_is_dropped_and_the_rest_load(tmp_path):
    store = Store(tmp_path / "data", budget_bytes=10**9)
    store.open()
    try:
        store.save(record())
        store.save(record(id="b" * 32))
        (store.session_dir("b" * 32) / "record.json").write_text("{not json")
        assert [r.id for r in store.session_records()] == ["a" * 32]
        assert not store.session_dir("b" * 32).exists()
    finally:
        store.close()


def test_one_server_per_data_dir_and_the_budget(tmp_path):
    first = Store(tmp_path / "data", budget_bytes=100)
    first.open()
    try:
        with pytest.raises(ConfigError, match="in use by another cloche server"):
            Store(tmp_path / "data", budget_bytes=100).open()
        first.reserve(100)
        with pytest.raises(StorageFull, match="--data-max-mib"):
            first.reserve(101)
    finally:
        first.close()


def test_the_budget_counts_sessions_and_snapshots_not_templates_beside_them(tmp_path):
    root = tmp_path / "data"
    (root / "templates" / "debian" / "rootfs").mkdir(parents=True)
    (root / "templates" / "debian" / "rootfs" / "big").write_bytes(b"x" * 5000)
    (root / "snapshots" / "s1").mkdir(parents=True)
    (root / "snapshots" / "s1" / "image").write_bytes(b"x" * 300)
    store = Store(root, budget_bytes=1000)
    store.open()
    try:
        assert store.used_bytes == 300
        store.reserve(700)
    finally:
        store.close()


def test_forgetting_all_deletes_every_session_and_snapshot_and_nothing_beside(tmp_path):
    """What a cluster node's successor does with what its killed predecessor kept."""
    store = Store(tmp_path / "data", budget_bytes=10**9)
    store.open()
    try:
        store.save(record())
        (store.session_dir("a" * 32) / "image").write_bytes(b"x" * 1000)
        store.snapshot_dir("s" * 32).mkdir()
        (store.snapshot_dir("s" * 32) / "image").write_bytes(b"y" * 1000)
        (tmp_path / "data" / "templates").mkdir()
        store.used_bytes = 2000
        store.forget_all()
        assert store.session_records() == [] and store.snapshot_records() == []
        assert list(store.sessions.iterdir()) == list(store.snapshots.iterdir()) == []
        assert store.used_bytes == 0 and (tmp_path / "data" / "templates").is_dir()
    finally:
        store.close()
