"""Completions, help and history from a live gVisor session, asked by silent cells that
leave the session's namespace and count alone."""

from __future__ import annotations

import pytest

from cloche.sessions import introspection


@pytest.fixture
def session(server):  # type: ignore[no-untyped-def]
    manager = server.server.manager
    info = server.call(manager.create(None))
    server.call(
        manager.execute(info.id, "import json\nvalue_one = 1\nvalue_two = [1, 2]\n!echo hi")
    )
    yield manager, info.id
    server.call(manager.close(info.id))


def test_completions_come_from_the_live_namespace(server, session) -> None:  # type: ignore[no-untyped-def]
    manager, session_id = session
    found = server.call(introspection.complete(manager, session_id, "x = value_", 10, None))
    assert found["matches"] == ["value_one", "value_two"]
    assert (found["cursor_start"], found["cursor_end"]) == (4, 10)
    dotted = server.call(introspection.complete(manager, session_id, "json.dum", 8, None))
    assert {"json.dump", "json.dumps"} <= set(m.rstrip("(") for m in dotted["matches"])
    assert dotted["cursor_start"] == 0


def test_help_and_history_and_nothing_counted(server, session) -> None:  # type: ignore[no-untyped-def]
    manager, session_id = session
    text = server.call(introspection.inspect(manager, session_id, "json.dumps(", 11, 0, None))
    assert text is not None and "Serialize" in text and "Signature" in text
    none = server.call(introspection.inspect(manager, session_id, "nothing_here", 3, 0, None))
    assert none is None
    cells = server.call(manager.history(session_id, None))
    assert [(c.execution_count, c.code) for c in cells] == [
        (1, "import json\nvalue_one = 1\nvalue_two = [1, 2]\n!echo hi")
    ]
    after = server.call(manager.execute(session_id, "sorted(k for k in dir() if k[0] == '_')"))
    assert after.execution_count == 2  # the asks were not counted
    assert "_introspect" not in str(after.result)  # nor left anything in the namespace
