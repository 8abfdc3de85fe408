"""Cell history, metadata and end reasons through the SDK (operations.md), real gVisor."""

from __future__ import annotations

import datetime

import pytest

import cloche
from cloche.client import verbs as aio


def test_the_history_comes_back_as_typed_cells(session):
    assert session.run("print('hello')\n6 * 7").end_reason == "ok"
    assert session.run("1 / 0").end_reason == "error"
    assert session.run("while True: pass", timeout=1).end_reason == "timeout"
    first, second, third = session.history()
    assert (first.number, second.number, third.number) == (1, 2, 3)
    assert first.code == "print('hello')\n6 * 7"
    assert first.execution.logs.stdout == "hello\n"
    assert first.execution.text == "42"
    assert (first.end_reason, first.execution.status, first.front_end) == ("ok", "ok", "http")
    assert first.started_at.tzinfo is datetime.UTC
    assert first.ended_at >= first.started_at
    assert first.execution.execution_count == 1
    assert second.execution.error is not None
    assert second.execution.error.ename == "ZeroDivisionError"
    assert (second.end_reason, third.end_reason) == ("error", "timeout")
    assert third.execution.duration_ms >= 1000

    assert session.cell(2).code == "1 / 0"
    assert [cell.number for cell in session.history(after=1, limit=1)] == [2]
    assert [cell.number for cell in session.history(after=3)] == []
    with pytest.raises(cloche.CellNotFound) as missing:
        session.cell(99)
    assert (missing.value.session_id, missing.value.number) == (session.id, 99)
    assert "no cell 99" in str(missing.value)
    last = session.refresh().last_cell
    assert last is not None and (last["number"], last["end_reason"]) == (3, "timeout")


def test_a_closed_sessions_history_is_not_found(client):
    session = client.create_session()
    session.run("x = 1")
    session.close()
    with pytest.raises(cloche.SessionNotFound):
        session.history()
    with pytest.raises(cloche.SessionNotFound):
        session.cell(1)


async def test_the_whole_history_is_read_page_by_page(url, token, monkeypatch):
    monkeypatch.setattr(aio, "HISTORY_PAGE", 2)  # 5 cells: pages of 2, 2 and 1
    async with cloche.AsyncClient(url, token) as client:
        async with await client.create_session() as session:
            for number in range(1, 6):
                await session.run(f"print({number})")
            every = await session.history()
            assert [cell.number for cell in every] == [1, 2, 3, 4, 5]
            assert [cell.execution.logs.stdout for cell in every] == [f"{n}\n" for n in range(1, 6)]
            assert [cell.number for cell in await session.history(limit=3)] == [1, 2, 3]
            assert [cell.number for cell in await session.history(after=1, limit=4)] == [2, 3, 4, 5]
            assert (await session.cell(4)).code == "print(4)"


def test_metadata_is_set_updated_and_filters_the_listing(client):
    with (
        client.create_session(metadata={"agent": "planner", "run": "42"}) as planner,
        client.create_session(metadata={"agent": "coder", "run": "42"}) as coder,
        client.create_session() as plain,
    ):
        assert planner.metadata == {"agent": "planner", "run": "42"}
        assert plain.metadata == {}

        def listed(**filters: object) -> set[str]:
            return {info.id for info in client.list_sessions(**filters)}  # type: ignore[arg-type]

        assert listed() == {planner.id, coder.id, plain.id}
        assert listed(metadata={"run": "42"}) == {planner.id, coder.id}
        assert listed(metadata={"run": "42", "agent": "coder"}) == {coder.id}
        assert listed(metadata={"agent": "nobody"}) == set()
        assert {i.id: i.metadata for i in client.list_sessions()}[planner.id] == planner.metadata

        updated = coder.update_metadata({"agent": None, "stage": "review"})
        assert updated.metadata == coder.metadata == {"run": "42", "stage": "review"}
        assert client.get_session(coder.id).metadata == {"run": "42", "stage": "review"}
        assert listed(metadata={"agent": "coder"}) == set()

        planner.pause()
        assert listed(state="paused") == {planner.id}
        assert listed(state="idle", metadata={"run": "42"}) == {coder.id}
        assert listed(profile="lean") == {planner.id, coder.id, plain.id}
        assert listed(profile="data") == set()


@pytest.mark.parametrize(
    ("metadata", "why"),
    [
        ({f"k{i}": "v" for i in range(33)}, "at most 32"),
        ({"big": "x" * 5000}, "at most 4096"),
        ({"n": 1}, "valid string"),
    ],
)
def test_bad_metadata_is_refused_as_invalid_metadata(client, metadata, why):
    with pytest.raises(cloche.InvalidMetadata, match=why):
        client.create_session(metadata=metadata)
    assert client.list_sessions() == []


def test_an_update_past_the_limits_is_refused_and_keeps_the_metadata(client):
    with client.create_session(metadata={"keep": "me"}) as session:
        with pytest.raises(cloche.InvalidMetadata, match="at most 32"):
            session.update_metadata({f"k{i}": "v" for i in range(40)})
        assert session.refresh().metadata == {"keep": "me"}


def test_an_admins_listing_spans_tenants_and_shows_what_sandboxes_use(make_server):
    server = make_server(
        pool_size=1, tokens=frozenset({"user-a"}), admin_tokens=frozenset({"root-a"})
    )
    url = f"http://127.0.0.1:{server.http_port}"
    with cloche.Client(url, "user-a") as user, cloche.Client(url, "root-a") as admin:
        with user.create_session() as mine:
            mine.run("x = 1")
            assert admin.list_sessions() == []  # its own: none
            everyone = admin.list_sessions(every_tenant=True)
            assert [info.id for info in everyone] == [mine.id]
            assert everyone[0].cpu_s is not None and everyone[0].cpu_s > 0
            assert everyone[0].memory_bytes is not None and everyone[0].memory_bytes > 0
            assert [info.id for info in user.list_sessions(every_tenant=True)] == [mine.id]
