"""A new session over the REPL TCP protocol may ask for a template, as it may ask for a
profile; an unknown one is a clear error reply, and nothing is made."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from cloche.client.tcp import TCPClient
from cloche.sandbox.images import TemplateSource
from images_support import small_root
from support import ServerThread


@pytest.fixture(scope="module")
def tiny(server: ServerThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ready template of a tiny root (no python of its own: cells run on cloche's)."""
    manager = server.server.manager
    tarball = small_root(tmp_path_factory.mktemp("tiny") / "tiny.tar")
    server.call(manager.build_template("tiny", TemplateSource("tar", str(tarball))))
    deadline = time.monotonic() + 300
    while (info := server.call(manager.template("tiny"))).state.value == "building":  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the template was not built in time"
        time.sleep(0.1)
    assert info.state.value == "ready", info.error  # type: ignore[attr-defined]
    yield "tiny"
    server.call(manager.delete_template("tiny"))


def test_a_new_session_is_made_of_the_template_asked(server, client: TCPClient, tiny):
    reply = client.request({"code": "print(open('/bin/sh').read())", "template": tiny})
    assert reply["status"] == "ok", reply
    assert reply["output"] == "#!not really a shell\n\n"  # the template's own root
    session_id = reply["session_id"]
    info = server.call(server.server.manager.info(session_id))
    assert info.template == "tiny"  # type: ignore[attr-defined]
    (cell,) = server.call(server.server.manager.history(session_id))  # type: ignore[misc]
    assert cell.front_end == "tcp"
    again = client.run("1 + 1", session_id)
    assert again["output"] == "2\n"
    server.call(server.server.manager.close(session_id))


def test_an_unknown_template_is_a_clear_error_and_makes_nothing(server, client: TCPClient):
    before = server.server.manager.list(None)
    reply = client.request({"code": "1", "template": "no-such-template"})
    assert reply["status"] == "error"
    assert reply["error"] == "Template no-such-template not found"
    assert "session_id" not in reply
    assert server.server.manager.list(None) == before
    refused = client.request({"code": "1", "template": 7})
    assert refused == {"status": "error", "error": "Invalid request: 'template' must be a string"}
    assert client.run("'still serving'")["output"] == "'still serving'\n"
