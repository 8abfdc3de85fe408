"""The REPL TCP protocol against a real gVisor server (see the TCP protocol spec)."""

from __future__ import annotations

import json
import socket
import struct
import threading
import uuid

import pytest

from cloche.client.tcp import TCPClient
from cloche.errors import IncompleteRead


def test_greeting_comes_first(server):
    with TCPClient("127.0.0.1", server.tcp_port) as client:
        assert client.greeting["status"] == "ok"
        assert "session_id" in client.greeting["message"]


def test_new_session_echoes_the_final_expression(client):
    reply = client.run("1+1")
    assert reply["status"] == "ok"
    assert reply["output"] == "2\n"
    assert uuid.UUID(reply["session_id"]).version == 4  # a random UUID, as kernel ids are


def test_print_is_output_and_none_is_not_echoed(client):
    reply = client.run("print(1)")
    assert reply["output"] == "1\n"
    reply = client.run("None", reply["session_id"])
    assert reply["output"] == ""


def test_state_persists_between_cells(client):
    sid = client.run("import math\nx = 40")["session_id"]
    assert client.run("def f(y):\n    return x + y", sid)["status"] == "ok"
    assert client.run("f(2), math.pi > 3", sid)["output"] == "(42, True)\n"


def test_exception_is_an_error_with_traceback_and_earlier_output(client):
    reply = client.run("print('before')\ndef g():\n    return 1/0\ng()")
    assert reply["status"] == "error"
    assert reply["output"] == "before\n"
    error = reply["error"]
    assert 'File "<cell-1>", line 4, in <module>' in error
    assert 'File "<cell-1>", line 3, in g' in error
    assert "ZeroDivisionError: division by zero" in error
    assert "kernel" not in error  # none of the kernel's own frames
    assert client.run("'alive'", reply["session_id"])["output"] == "'alive'\n"


def test_a_long_session_keeps_only_the_sources_that_can_still_run(client):
    """A function's source stays for its tracebacks; plain cells' sources don't pile up
    (a million of them would be ~350 MB of the session's memory)."""
    sid = client.run("def g():\n    return 1 / 0  # defined in cell one")["session_id"]
    client.run("import linecache\ni = 0", sid)
    base = int(client.run("len(linecache.cache)", sid)["output"])
    for _ in range(300):
        assert client.run("i += 1", sid)["status"] == "ok"
    assert int(client.run("len(linecache.cache)", sid)["output"]) <= base + 1
    error = client.run("i, g()", sid)["error"]
    assert 'File "<cell-1>", line 2, in g' in error
    assert "return 1 / 0  # defined in cell one" in error


def test_syntax_error_is_an_error(client):
    reply = client.run("def (:")
    assert reply["status"] == "error"
    assert "SyntaxError" in reply["error"]
    assert "<cell-1>" in reply["error"]
    assert "ast.py" not in reply["error"]


def test_stdout_and_stderr_are_captured_at_the_fd_level(client):
    code = (
        "import os, subprocess, sys\n"
        "print('py')\n"
        "os.write(1, b'fd1\\n')\n"
        "sys.stdout.flush()\n"
        "subprocess.run(['echo', 'child'])\n"
        "os.system('echo shell >&2')\n"
        "None"
    )
    reply = client.run(code)
    assert reply["status"] == "ok", reply
    assert reply["output"] == "py\nfd1\nchild\nshell\n"


def test_fake_frames_written_to_stdout_are_just_output(client):
    fake = struct.pack(">I", 20) + b'{"op":"done"}'
    reply = client.run(f"import os; os.write(1, {fake!r}); os.write(2, {fake!r}); 7")
    assert reply["status"] == "ok"
    assert reply["output"].endswith("7\n")


def test_unknown_session_is_not_found_and_nothing_runs(client):
    reply = client.run("1", "0" * 32)
    assert reply == {"status": "error", "error": f"Session {'0' * 32} not found"}


def test_empty_session_id_creates_a_session(client):
    reply = client.request({"code": "3", "session_id": ""})
    assert reply["status"] == "ok" and reply["output"] == "3\n"


@pytest.mark.parametrize(
    "body",
    [b"not json", b"\xff\xfe", b"[1, 2]", b'"text"', b'{"code": 5}', b'{"session_id": "x"}'],
)
def test_invalid_request_gets_an_error_frame_and_the_connection_keeps_working(client, body):
    client.sock.sendall(struct.pack(">I", len(body)) + body)
    reply = client.receive()
    assert reply["status"] == "error"
    assert "Invalid" in reply["error"]
    assert client.run("2*3")["output"] == "6\n"


def test_oversized_frame_gets_an_error_then_close(server):
    with TCPClient("127.0.0.1", server.tcp_port) as client:
        client.sock.sendall(struct.pack(">I", 2**31))
        reply = client.receive()
        assert reply["status"] == "error"
        assert "too large" in reply["error"]
        with pytest.raises((IncompleteRead, ConnectionError)):
            client.receive()


def test_one_session_from_two_connections(server):
    with server.client() as first, server.client() as second:
        sid = first.run("shared = 'yes'")["session_id"]
        assert second.run("shared", sid)["output"] == "'yes'\n"


def test_length_and_body_in_separate_writes_are_read_whole(client):
    body = json.dumps({"code": "5"}).encode()
    client.sock.sendall(struct.pack(">I", len(body)))
    client.sock.sendall(body[:3])
    client.sock.sendall(body[3:])
    assert client.receive()["output"] == "5\n"


def test_the_original_concurrent_clients_scenario(server):
    """Two clients at once: sessions, functions and a shared variable name; a third checks."""
    results: dict[str, dict[str, str]] = {}

    def use(name: str, value: int) -> None:
        with server.client() as c:
            sid = c.run(f"counter = {value}\ndef bump():\n    global counter\n    counter += 1")[
                "session_id"
            ]
            c.run(f"{name}_only = '{name}'", sid)
            c.run("import time; time.sleep(0.5); bump()", sid)
            results[name] = {"sid": sid, "counter": c.run("counter", sid)["output"]}

    threads = [threading.Thread(target=use, args=(n, v)) for n, v in (("a", 10), ("b", 100))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["a"]["counter"] == "11\n"
    assert results["b"]["counter"] == "101\n"
    with server.client() as third:
        leak = third.run("a_only", results["b"]["sid"])
        assert leak["status"] == "error" and "NameError" in leak["error"]
        assert third.run("b_only", results["b"]["sid"])["output"] == "'b'\n"
        assert third.run("counter", results["a"]["sid"])["output"] == "11\n"


def test_twenty_sessions_from_twenty_connections_give_separate_results(server):
    errors: list[str] = []
    outputs: dict[int, str] = {}

    def worker(i: int) -> None:
        try:
            with server.client() as c:
                sid = c.run(f"n = {i}")["session_id"]
                for _ in range(5):
                    c.run("n = n * 2", sid)
                outputs[i] = c.run("n", sid)["output"]
        except Exception as exc:  # collected and asserted below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert outputs == {i: f"{i * 32}\n" for i in range(20)}


def test_client_that_sends_nothing_is_dropped_after_the_timeout(make_server):
    quick = make_server(connection_idle_timeout_s=0.5, pool_size=0)
    with socket.create_connection(("127.0.0.1", quick.tcp_port), timeout=10) as sock:
        sock.recv(4096)  # greeting
        assert sock.recv(1) == b""  # closed by the server, not by our timeout
