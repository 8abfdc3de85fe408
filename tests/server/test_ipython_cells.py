"""IPython cell syntax in a real gVisor sandbox, over the TCP protocol (and HTTP for
streaming): shell commands, magics, help, and what the sandbox's shell can run."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cloche.client.tcp import TCPClient
from support import TIME, ServerThread, sse_events, timeit_printed


@pytest.fixture(scope="module")
def tcp(server: ServerThread) -> Iterator[TCPClient]:
    with server.client() as connection:
        yield connection


@pytest.fixture(scope="module")
def shared(tcp: TCPClient) -> str:
    """One session for the tests that leave nothing behind that others would see."""
    reply = tcp.run("1")
    assert reply["status"] == "ok", reply
    return str(reply["session_id"])


def ok(tcp: TCPClient, code: str, session_id: str | None = None, **extra: Any) -> dict[str, Any]:
    reply = tcp.run(code, session_id, **extra)
    assert reply["status"] == "ok", reply
    return reply


def test_the_sandbox_has_a_shell_and_the_usual_tools(tcp, shared):
    tools = ["sh", "bash", "ls", "cat", "echo", "grep", "sed", "head", "tail", "wc", "sort"]
    reply = ok(tcp, f"!ls /bin/sh && for t in {' '.join(tools)}; do command -v $t; done", shared)
    lines = reply["output"].splitlines()
    assert lines[0] == "/bin/sh"
    assert [line.rsplit("/", 1)[-1] for line in lines[1:]] == tools


def test_a_command_prints_as_the_cells_output(tcp, shared):
    reply = ok(tcp, "!echo hi\nprint('after')", shared)
    assert reply["output"] == "hi\nafter\n"


def test_a_commands_output_streams_as_it_happens(server):
    """The command waits for a file the test writes only once it saw the first line."""
    code = "!echo first; while [ ! -e go ]; do sleep 0.01; done; echo second"
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as http:
        session_id = http.post("/v1/sessions").json()["id"]
        try:
            stdout = ""
            with http.stream(
                "POST",
                f"/v1/sessions/{session_id}/execute",
                json={"code": code},
                headers={"Accept": "text/event-stream"},
            ) as response:
                for name, data in sse_events(response):
                    if name == "stdout":
                        stdout += data["text"]
                        if stdout == "first\n":
                            put = http.put(f"/v1/sessions/{session_id}/files/go", content=b"")
                            assert put.status_code == 204
                    if name == "done":
                        assert data["status"] == "ok", data
            assert stdout == "first\nsecond\n"
        finally:
            http.delete(f"/v1/sessions/{session_id}")


def test_assigning_a_command_gives_a_list_of_its_lines(tcp, shared):
    ok(tcp, "!mkdir -p listing && touch listing/a.py listing/b.txt", shared)
    reply = ok(tcp, "files = !ls listing\ntype(files).__name__, files, files.s", shared)
    assert reply["output"] == "('SList', ['a.py', 'b.txt'], 'a.py b.txt')\n"
    assert ok(tcp, "files.grep('py$')", shared)["output"] == "['a.py']\n"


def test_bash_cell(tcp, shared):
    reply = ok(tcp, "%%bash\nfor i in 1 2 3; do echo line $i; done | tail -n 2", shared)
    assert reply["output"] == "line 2\nline 3\n"


def test_python_values_expand_in_commands(tcp, shared):
    reply = ok(tcp, "name = 'sandbox'\nn = 20\n!echo $name {n + 1} $((n)) '$name' $$HOME", shared)
    assert reply["output"] == "sandbox 21 0 $name /home/user\n"  # $((n)): the shell's n


def test_time_and_timeit(tcp, shared):
    reply = ok(tcp, "%time sum(range(1000))", shared)
    pattern = rf"CPU times: user {TIME}, sys: {TIME}, total: {TIME}\nWall time: {TIME}\n499500\n"
    assert re.fullmatch(pattern, reply["output"]), reply["output"]
    reply = ok(tcp, "%timeit -n 3 -r 2 sum(range(100))", shared)
    assert re.fullmatch(timeit_printed("2 runs", "3 loops"), reply["output"]), reply["output"]


def test_writefile_then_read_it_back(tcp, shared):
    reply = ok(tcp, "%%writefile hello.py\nprint('hello from a file')", shared)
    assert reply["output"] == "Writing hello.py\n"
    assert ok(tcp, "!cat hello.py", shared)["output"] == "print('hello from a file')\n"
    assert ok(tcp, "%run hello.py", shared)["output"] == "hello from a file\n"
    reply = ok(tcp, "%%writefile -a hello.py\nprint('more')", shared)
    assert reply["output"] == "Appending to hello.py\n"
    assert ok(tcp, "open('hello.py').read().count('print')", shared)["output"] == "2\n"


def test_cd_and_pwd(tcp):
    session_id = ok(tcp, "import os\nhome = os.getcwd()")["session_id"]
    assert ok(tcp, "%cd /tmp", session_id)["output"] == "/tmp\n"
    assert ok(tcp, "%pwd", session_id)["output"] == "'/tmp'\n"
    assert ok(tcp, "!pwd", session_id)["output"] == "/tmp\n"
    ok(tcp, "%cd -q -", session_id)
    assert ok(tcp, "os.getcwd() == home", session_id)["output"] == "True\n"


def test_env(tcp, shared):
    assert ok(tcp, "%env GREETING=hello", shared)["output"] == "env: GREETING=hello\n"
    assert ok(tcp, "%env GREETING", shared)["output"] == "'hello'\n"
    assert ok(tcp, "!echo $GREETING", shared)["output"] == "hello\n"


def test_help_on_an_object(tcp, shared):
    ok(tcp, "def area(w, h=1):\n    'The area of a rectangle.'\n    return w * h", shared)
    reply = ok(tcp, "area?", shared)
    assert reply["output"].startswith(
        "Signature: area(w, h=1)\nDocstring: The area of a rectangle.\n"
    )
    assert "return w * h" in ok(tcp, "area??", shared)["output"]


def test_an_unknown_magic_is_a_usage_error(tcp, shared):
    reply = tcp.run("%autoreload 2", shared)
    assert reply["status"] == "error"
    assert "UsageError: Line magic function `%autoreload` not found." in reply["error"]
    assert "SyntaxError" not in reply["error"]
    assert ok(tcp, "'alive'", shared)["output"] == "'alive'\n"


def test_a_traceback_names_the_users_line(tcp, shared):
    reply = tcp.run("!true\nx = %pwd\nfor i in range(1):\n    !true\n    1 / 0", shared)
    assert reply["status"] == "error"
    assert 'File "<cell-' in reply["error"] and '", line 5, in <module>' in reply["error"]
    assert "    1 / 0" in reply["error"]
    assert "ZeroDivisionError" in reply["error"]


# The sandbox's processes but the kernel, its forks (the supervisor's spare leader is one)
# and its process supervisor (an interpreter of its own, running `procd.run`), skipping one
# that is gone between the listing and the reading.
FIND_OTHERS = (
    "def others():\n"
    "    mine, found = open('/proc/self/cmdline', 'rb').read(), []\n"
    "    for p in filter(str.isdigit, os.listdir('/proc')):\n"
    "        try:\n"
    "            line = open(f'/proc/{p}/cmdline', 'rb').read()\n"
    "        except OSError:\n"
    "            continue\n"
    "        if line != mine and b'procd.run' not in line:\n"
    "            found.append(p)\n"
    "    return found\n"
)
OTHER_PROCESSES = "others()"


def test_a_command_over_the_timeout_is_killed_and_the_session_goes_on(tcp):
    session_id = ok(tcp, "import os\nos.getpid()")["session_id"]
    reply = tcp.run("!sleep 30 & sleep 30", session_id, timeout_s=1.0)
    assert reply["status"] != "ok"
    assert ok(tcp, "!echo still here", session_id)["output"] == "still here\n"
    # Both sleeps were killed, and reaped by the kernel (pid 1 of the sandbox) once dead.
    assert _others_once_reaped(tcp, session_id) == "[]\n"


def test_what_a_command_leaves_in_the_background_is_reaped(tcp):
    session_id = ok(tcp, "import os")["session_id"]
    job = "(while [ ! -e finish ]; do sleep 0.01; done; echo late)"
    assert ok(tcp, f"!{job} & echo now", session_id)["output"] == "now\n"  # not held up
    ok(tcp, "open('finish', 'w').close()", session_id)
    assert _others_once_reaped(tcp, session_id) == "[]\n"


def _others_once_reaped(tcp: TCPClient, session_id: str) -> str:
    """The sandbox's processes besides the kernel once they are gone: each `!true` reaps
    what has died since; a dying process may take a while on a busy machine."""
    code = (
        FIND_OTHERS + "import time\n"
        "deadline = time.monotonic() + 20\n"
        f"while {OTHER_PROCESSES} and time.monotonic() < deadline:\n"
        "    !true\n"
        "    time.sleep(0.05)\n"
        f"{OTHER_PROCESSES}"
    )
    return str(ok(tcp, code, session_id)["output"])
