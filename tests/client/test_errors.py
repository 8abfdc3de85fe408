"""Failures of the server or the connection raise from one tree, naming what to change."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

import cloche
from cloche.client._errors import error_for
from cloche.config import Limits
from cloche.errors import ClientError, ClocheError, SessionError


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener.getsockname()[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_nothing_listening_names_the_url_setting():
    url = f"http://127.0.0.1:{free_port()}"
    with cloche.Client(url) as client, pytest.raises(cloche.ServerUnreachable) as raised:
        client.create_session()
    message = str(raised.value)
    assert url in message and "CLOCHE_URL" in message and "--url" in message
    assert isinstance(raised.value, ClientError) and isinstance(raised.value, ClocheError)


def test_the_url_comes_from_cloche_url_when_not_given(monkeypatch, url, token):
    monkeypatch.setenv("CLOCHE_URL", url)
    monkeypatch.setenv("CLOCHE_TOKEN", token)
    with cloche.Client() as client:
        assert (client.url, client.token) == (url, token)
        assert client.list_sessions() == []


def test_the_default_url_is_the_local_http_port():
    with cloche.Client() as client:
        assert client.url == "http://127.0.0.1:8080" and client.token is None


def test_no_answer_in_time_names_the_timeout_setting(silent_port):
    with cloche.Client(f"http://127.0.0.1:{silent_port}", timeout_s=0.5) as client:
        with pytest.raises(cloche.RequestTimeout) as raised:
            client.list_sessions()
    message = str(raised.value)
    assert "0.5 s" in message and "timeout_s" in message and "--request-timeout" in message


def test_a_missing_token_names_the_token_setting(url):
    with cloche.Client(url, token="") as client, pytest.raises(cloche.Unauthorized) as raised:
        client.create_session()
    message = str(raised.value)
    assert "needs a token" in message and "--token" in message and "CLOCHE_TOKEN" in message
    assert isinstance(raised.value, SessionError)


def test_a_wrong_token_is_refused(url):
    with cloche.Client(url, token="not-the-token") as client:
        with pytest.raises(cloche.Unauthorized, match="token was refused.*CLOCHE_TOKEN"):
            client.list_sessions()


def test_an_unknown_session_is_not_found(client):
    with pytest.raises(cloche.SessionNotFound) as raised:
        client.session("0123456789abcdef0123456789abcdef")
    assert raised.value.session_id == "0123456789abcdef0123456789abcdef"
    assert str(raised.value) == "Session 0123456789abcdef0123456789abcdef not found"
    with pytest.raises(cloche.SessionNotFound):
        client.close_session("0123456789abcdef0123456789abcdef")


def test_a_closed_session_is_not_found(client):
    session = client.create_session()
    client.close_session(session.id)
    with pytest.raises(cloche.SessionNotFound):
        session.run("1")
    with pytest.raises(cloche.SessionNotFound):
        session.upload("x.txt", "x")
    with pytest.raises(cloche.SessionNotFound):
        session.download("x.txt")
    with pytest.raises(cloche.SessionNotFound):
        session.interrupt()


def test_an_unknown_profile_is_an_invalid_request(client):
    with pytest.raises(cloche.InvalidRequest, match="profile"):
        client.create_session(profile="huge")


def test_a_url_that_is_not_cloche_is_an_unexpected_response(url, token):
    with cloche.Client(f"{url}/not-cloche", token) as client:
        with pytest.raises(cloche.UnexpectedResponse) as raised:
            client.list_sessions()
    assert raised.value.status_code == 404


def test_too_many_sessions_names_the_server_limit(make_server):
    server = make_server(pool_size=1, max_sessions=1, limits=Limits(pause_idle_s=0))
    with cloche.Client(f"http://127.0.0.1:{server.http_port}") as client:
        with client.create_session(), pytest.raises(cloche.TooManySessions) as raised:
            client.create_session()
    assert "--max-sessions" in str(raised.value)


def test_a_body_over_the_limit_names_the_server_limit(make_server):
    server = make_server(pool_size=1, max_frame_bytes=4096)
    with cloche.Client(f"http://127.0.0.1:{server.http_port}") as client:
        with client.create_session() as session:
            with pytest.raises(cloche.RequestTooLarge) as raised:
                session.run("'" + "x" * 10_000 + "'")
            session.upload("big.bin", b"x" * 10_000)  # a file is streamed: --disk-mib bounds it
            assert session.download("big.bin") == b"x" * 10_000
    assert "--max-frame-bytes" in str(raised.value)


def test_a_session_whose_sandbox_died_meanwhile_keeps_the_servers_why():
    gone = "Session abc is gone: the sandbox exited unexpectedly (exit status 2)"
    request = httpx.Request("DELETE", "http://127.0.0.1:8080/v1/sessions/abc/commands/12")
    response = httpx.Response(
        404, json={"error": {"type": "not_found", "message": gone}}, request=request
    )
    error = error_for(response, url="http://127.0.0.1:8080", token=None, session_id="abc")
    assert isinstance(error, cloche.SessionNotFound) and error.session_id == "abc"
    assert str(error) == gone
