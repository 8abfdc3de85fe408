"""Tokens: requests must carry one, and a session is visible only to the token that made it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def guarded(state_root):
    from support import ServerThread, make_config, require_gvisor

    require_gvisor()
    config = make_config(state_root, tokens=frozenset({"alpha-token", "beta-token"}), pool_size=1)
    with ServerThread(config) as running:
        yield running


def test_request_without_a_token_is_refused(guarded):
    with guarded.client() as c:
        reply = c.run("1")
        assert reply["status"] == "error"
        assert "Unauthorized" in reply["error"]
        assert "session_id" not in reply


def test_request_with_a_wrong_token_is_refused(guarded):
    with guarded.client() as c:
        assert "Unauthorized" in c.run("1", token="gamma-token")["error"]


def test_a_session_is_invisible_to_another_token(guarded):
    with guarded.client() as c:
        sid = c.run("mine = 1", token="alpha-token")["session_id"]
        assert c.run("mine", sid, token="alpha-token")["output"] == "1\n"
        other = c.run("mine", sid, token="beta-token")
        assert other == {"status": "error", "error": f"Session {sid} not found"}
        assert guarded.server.manager.list("beta-token") == []
        assert [s.id for s in guarded.server.manager.list("alpha-token")] == [sid]
