"""The E2B SDKs (e2b 2.63.0, e2b-code-interpreter 2.11.5), unmodified, against cloche and
real gVisor: sandboxes, code, files, commands, terminals, contexts, lifecycle, tenants."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    FileType,
    NotFoundException,
    PtySize,
    SandboxException,
    SandboxQuery,
    SandboxState,
)
from e2b_code_interpreter import Sandbox

from support import E2B_KEY as KEY
from support import E2B_OTHER as OTHER
from support import ServerThread

pytestmark = [pytest.mark.gvisor]
FIVE_MIB = bytes(range(256)) * (5 * 4096)  # 5 MiB, every byte value


def until(check, timeout_s: float = 60.0, what: str = "the condition"):
    """Poll check() until it is truthy (its value), or fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not hold within {timeout_s} s")
        time.sleep(0.1)


@pytest.fixture
def sbx(e2b_env: dict[str, str]) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=600)
    yield sandbox
    try:
        sandbox.kill()
    except SandboxException:
        pass


def test_create_and_run_code_keeps_state_and_streams(sbx: Sandbox) -> None:
    assert sbx.run_code("x = 41").error is None
    said: list[str] = []
    execution = sbx.run_code(
        "import sys\nprint('one')\nprint('two', file=sys.stderr)\nx + 1",
        on_stdout=lambda m: said.append(f"out:{m.line}"),
        on_stderr=lambda m: said.append(f"err:{m.line}"),
    )
    assert execution.text == "42"
    assert execution.logs.stdout == ["one\n"] and execution.logs.stderr == ["two\n"]
    assert said == ["out:one\n", "err:two\n"]
    assert execution.execution_count >= 2
    assert sbx.run_code("'a string'").text == "a string"


def test_run_code_gives_png_results_and_errors(sbx: Sandbox) -> None:
    execution = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()\n"
        "class Bold:\n    def _repr_html_(self):\n        return '<b>hi</b>'\n"
        "display(Bold())"
    )
    assert execution.error is None, execution.error
    pngs = [r.png for r in execution.results if r.png]
    assert pngs and pngs[0].startswith("iVBORw0KGgo")  # base64 of the PNG signature
    assert any(r.html == "<b>hi</b>" for r in execution.results)
    errors = []
    failed = sbx.run_code("1 / 0", on_error=errors.append)
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert (
        "division by zero" in failed.error.value and "ZeroDivisionError" in failed.error.traceback
    )
    assert errors and errors[0].name == "ZeroDivisionError"


def test_pip_of_a_present_package_succeeds_offline(sbx: Sandbox) -> None:
    execution = sbx.run_code("!pip install numpy pandas\nimport numpy\nnumpy.__name__")
    assert execution.error is None, execution.error
    assert execution.text == "numpy"


def test_files_write_read_list_remove_make_dir_rename(sbx: Sandbox) -> None:
    info = sbx.files.write("/home/user/notes/a.txt", "hello")
    assert info.path == "/home/user/notes/a.txt"
    assert sbx.files.read("/home/user/notes/a.txt") == "hello"
    assert sbx.run_code("open('/home/user/notes/a.txt').read()").text == "hello"
    assert sbx.files.make_dir("/home/user/notes/sub") is True
    assert sbx.files.make_dir("/home/user/notes/sub") is False
    names = {e.name: e.type for e in sbx.files.list("/home/user/notes")}
    assert names == {"a.txt": FileType.FILE, "sub": FileType.DIR}
    deep = sbx.files.list("/home/user/notes", depth=2)
    assert {e.path for e in deep} >= {"/home/user/notes/a.txt", "/home/user/notes/sub"}
    moved = sbx.files.rename("/home/user/notes/a.txt", "/home/user/notes/sub/b.txt")
    assert moved.path == "/home/user/notes/sub/b.txt"
    assert sbx.files.exists("/home/user/notes/sub/b.txt")
    assert not sbx.files.exists("/home/user/notes/a.txt")
    entry = sbx.files.get_info("/home/user/notes/sub/b.txt")
    assert entry.size == 5 and entry.owner == "user"
    sbx.files.remove("/home/user/notes")
    assert not sbx.files.exists("/home/user/notes")
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/home/user/notes/sub/b.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.remove("/home/user/nothing-here")


def test_files_as_the_user_named(sbx: Sandbox) -> None:
    with pytest.raises(SandboxException):
        sbx.files.write("/etc/owned-by-user", "no")  # user may not write /etc
    made = sbx.files.write("/etc/cloche-e2b-test", "yes", user="root")
    assert made.path == "/etc/cloche-e2b-test"
    assert sbx.files.get_info("/etc/cloche-e2b-test").owner == "root"
    assert sbx.files.make_dir("/workspace/deep") is True  # a top-level dir, as envd allows
    assert sbx.files.get_info("/workspace").owner == "user"
    assert sbx.commands.run("touch /workspace/deep/f && echo ok").stdout == "ok\n"


def test_five_mib_byte_exact_and_gzip(sbx: Sandbox) -> None:
    sbx.files.write("/home/user/big.bin", FIVE_MIB)
    assert bytes(sbx.files.read("/home/user/big.bin", format="bytes")) == FIVE_MIB
    digest = sbx.commands.run("sha256sum /home/user/big.bin").stdout.split()[0]
    import hashlib

    assert digest == hashlib.sha256(FIVE_MIB).hexdigest()
    sbx.files.write("/home/user/big.gz.bin", FIVE_MIB, gzip=True)
    assert bytes(sbx.files.read("/home/user/big.gz.bin", format="bytes", gzip=True)) == FIVE_MIB
    several = sbx.files.write_files(
        [
            {"path": "/home/user/m/one.txt", "data": "1"},
            {"path": "/home/user/m/two.txt", "data": b"2"},
        ]
    )
    assert sorted(w.path for w in several) == ["/home/user/m/one.txt", "/home/user/m/two.txt"]
    assert sbx.files.read("/home/user/m/two.txt") == "2"


def test_files_endpoints_both_ways_raw(sbx: Sandbox, e2b_env: dict[str, str]) -> None:
    """/files as envd answers it: multipart with several files, octet-stream gzip, 404 JSON."""
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": sbx._envd_access_token or "",
    }
    url = e2b_env["E2B_SANDBOX_URL"] + "/files"
    with httpx.Client(headers=headers, timeout=60) as http:
        files = [("file", ("/home/user/r/x.txt", b"x")), ("file", ("/home/user/r/y.txt", b"y"))]
        reply = http.post(url, files=files)
        assert reply.status_code == 200, reply.text
        assert [w["name"] for w in reply.json()] == ["x.txt", "y.txt"]
        packed = gzip.compress(b"packed")
        reply = http.post(
            url,
            params={"path": "r/z.txt"},  # relative to the user's home
            content=packed,
            headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
        )
        assert reply.status_code == 200 and reply.json()[0]["path"] == "/home/user/r/z.txt"
        assert http.get(url, params={"path": "/home/user/r/z.txt"}).content == b"packed"
        missing = http.get(url, params={"path": "/home/user/none"})
        assert missing.status_code == 404 and set(missing.json()) == {"code", "message"}
        bad = http.post(
            url,
            params={"path": "/home/user/q"},
            content=b"not gzip",
            headers={"Content-Encoding": "gzip"},
        )
        assert bad.status_code == 400
        assert not sbx.files.exists("/home/user/q")  # nothing half-written is left
        wrong = http.get(
            url, params={"path": "/home/user/r/z.txt"}, headers={"X-Access-Token": "wrong"}
        )
        assert wrong.status_code == 401


def test_watch_dir(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/watched")
    handle = sbx.files.watch_dir("/home/user/watched")
    sbx.files.write("/home/user/watched/new.txt", "x")
    events = until(handle.get_new_events, 30, "a create event")
    assert any(e.name == "new.txt" and e.type.value == "create" for e in events)
    sbx.files.remove("/home/user/watched/new.txt")
    events = until(handle.get_new_events, 30, "a remove event")
    assert any(e.name == "new.txt" and e.type.value == "remove" for e in events)
    handle.stop()


def test_commands_exit_codes_streaming_background_list_kill_stdin(sbx: Sandbox) -> None:
    result = sbx.commands.run("echo out; echo err >&2")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "out\n", "err\n")
    with pytest.raises(CommandExitException) as raised:
        sbx.commands.run("exit 3")
    assert raised.value.exit_code == 3
    with pytest.raises(CommandExitException) as raised:
        sbx.commands.run("setsid sh -c 'echo led; exit 4'")
    assert raised.value.exit_code == 4 and raised.value.stdout == "led\n"
    seen: list[str] = []
    sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
    assert "".join(seen) == "1\n2\n3\n"
    assert sbx.commands.run("whoami; pwd").stdout == "user\n/home/user\n"
    assert sbx.commands.run("echo $GREETING", envs={"GREETING": "hi"}).stdout == "hi\n"
    background = sbx.commands.run("sleep 300", background=True)
    assert background.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(background.pid) is True
    until(lambda: background.pid not in [p.pid for p in sbx.commands.list()], 30, "the kill")
    assert sbx.commands.kill(999999) is False
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "fed through stdin\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "fed through stdin\n"
    connected = sbx.commands.run("sleep 1; echo late", background=True)
    again = sbx.commands.connect(connected.pid)
    assert again.wait().stdout == "late\n"


def test_pty_create_send_stdin_resize(sbx: Sandbox) -> None:
    output = bytearray()
    terminal = sbx.pty.create(PtySize(rows=24, cols=80), timeout=120)
    reader = threading.Thread(target=lambda: _drain(terminal, output), daemon=True)
    reader.start()
    sbx.pty.send_stdin(terminal.pid, b"echo $((6*7)); stty size\n")
    until(lambda: b"42" in output and b"24 80" in output, 60, "the terminal's answer")
    sbx.pty.resize(terminal.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(terminal.pid, b"stty size\n")
    until(lambda: b"30 100" in output, 60, "the resized terminal")
    sbx.pty.send_stdin(terminal.pid, b"exit\n")
    reader.join(60)
    assert not reader.is_alive()


def _drain(terminal, output: bytearray) -> None:
    try:
        terminal.wait(on_pty=output.extend)
    except CommandExitException:
        pass


def test_connect_from_another_process(sbx: Sandbox) -> None:
    sbx.run_code("shared = 'from the first process'")
    script = (
        "import sys\nfrom e2b_code_interpreter import Sandbox\n"
        "other = Sandbox.connect(sys.argv[1])\n"
        "print(other.run_code('shared').text)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, sbx.sandbox_id],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "from the first process"


def test_list_with_metadata_and_pages(e2b_env: dict[str, str]) -> None:
    made = [Sandbox.create(metadata={"run": "list-test", "n": str(i)}) for i in range(3)]
    try:
        query = SandboxQuery(metadata={"run": "list-test"})
        found = Sandbox.list(query=query).next_items()
        assert sorted(s.sandbox_id for s in found) == sorted(s.sandbox_id for s in made)
        assert {s.metadata["n"] for s in found} == {"0", "1", "2"}
        pages = Sandbox.list(query=query, limit=2)
        first = pages.next_items()
        assert len(first) == 2 and pages.has_next
        second = pages.next_items()
        assert len(second) == 1 and not pages.has_next
        one = Sandbox.list(query=SandboxQuery(metadata={"n": "1", "run": "list-test"}))
        assert [s.sandbox_id for s in one.next_items()] == [made[1].sandbox_id]
    finally:
        for sandbox in made:
            sandbox.kill()


def test_pause_and_connect_resumes(sbx: Sandbox) -> None:
    sbx.run_code("kept = 'across a pause'")
    sbx.commands.run("echo on-disk > /home/user/p.txt")
    assert sbx.pause() is True
    assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
    assert sbx.pause() is False  # already paused: the SDK's 409
    paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
    assert sbx.sandbox_id in [s.sandbox_id for s in paused]
    back = Sandbox.connect(sbx.sandbox_id)
    assert back.get_info().state.value == "running"
    assert back.run_code("kept").text == "across a pause"
    assert back.files.read("/home/user/p.txt") == "on-disk\n"


def test_set_timeout_get_info_kill(sbx: Sandbox) -> None:
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id and info.template_id == "code-interpreter-v1"
    sbx.set_timeout(3600)
    later = sbx.get_info().end_at
    assert (later - info.started_at).total_seconds() > 3000
    sbx.set_timeout(2)  # shortened: it ends by itself
    until(lambda: not sbx.is_running(), 60, "the sandbox's end at its timeout")
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)


def test_kill_ends_the_sandbox(e2b_env: dict[str, str]) -> None:
    sandbox = Sandbox.create()
    assert sandbox.is_running()
    assert sandbox.kill() is True
    assert not sandbox.is_running()
    assert Sandbox.kill(sandbox.sandbox_id) is False
    with pytest.raises(SandboxException):
        sandbox.run_code("1")


def test_code_contexts(sbx: Sandbox) -> None:
    context = sbx.create_code_context(language="python")
    assert context.language == "python"
    assert sbx.run_code("y = 5\ny * 2", context=context).text == "10"
    assert context.id in [c.id for c in sbx.list_code_contexts()]
    shell = sbx.create_code_context(language="bash", cwd="/tmp")
    ran = sbx.run_code("echo $((1+2)); pwd", context=shell)
    assert ran.logs.stdout == ["3\n/tmp\n"] or "".join(ran.logs.stdout) == "3\n/tmp\n"
    assert "".join(sbx.run_code("echo hi", language="bash").logs.stdout) == "hi\n"
    assert sbx.run_code("exit 2", language="bash").error is not None
    sbx.remove_code_context(shell)
    assert shell.id not in [c.id for c in sbx.list_code_contexts()]
    with pytest.raises(SandboxException) as raised:
        sbx.run_code("console.log(1)", language="javascript")
    assert "400" in str(raised.value) and "python, bash" in str(raised.value)
    with pytest.raises(SandboxException):
        sbx.create_code_context(language="r")


def test_a_wrong_key_is_an_authentication_error(e2b_env: dict[str, str]) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_not_a_token_of_this_server")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="wrong").next_items()


def test_another_tenants_sandbox_is_not_found(sbx: Sandbox) -> None:
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id, api_key=OTHER)
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id, api_key=OTHER)
    assert Sandbox.kill(sbx.sandbox_id, api_key=OTHER) is False
    theirs = Sandbox.list(api_key=OTHER).next_items()
    assert sbx.sandbox_id not in [s.sandbox_id for s in theirs]
    assert sbx.is_running()


def test_the_sandbox_cant_reach_the_server(sbx: Sandbox, server: ServerThread) -> None:
    import socket

    hosts = ["127.0.0.1", socket.gethostbyname(socket.gethostname())]
    for host in hosts:
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(({host!r}, {server.http_port}), timeout=3)\n"
            "    reached = 'reached'\n"
            "except OSError as exc:\n"
            "    reached = type(exc).__name__\n"
            "reached"
        )
        assert sbx.run_code(code).text != "reached", host
    with pytest.raises(CommandExitException):
        sbx.commands.run(f"exec 3<>/dev/tcp/{hosts[-1]}/{server.http_port}", timeout=30)


def test_a_sandbox_is_a_cloche_session(sbx: Sandbox, server: ServerThread) -> None:
    sbx.run_code("1 + 1")
    sbx.commands.run("true")
    base = f"http://127.0.0.1:{server.http_port}"
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}) as http:
        ids = [s["id"] for s in http.get("/v1/sessions").json()["sessions"]]
        assert sbx.sandbox_id in ids
        cells = http.get(f"/v1/sessions/{sbx.sandbox_id}/cells").json()["cells"]
        assert {c["front_end"] for c in cells} == {"e2b"}
        assert {c.get("kind", "cell") for c in cells} >= {"command"}
        made = http.post("/v1/sessions", json={}).json()["id"]
    other = Sandbox.connect(made)  # a session made over /v1, reached from E2B
    assert other.run_code("6 * 7").text == "42"
    other.kill()


def test_bad_requests_get_clear_errors(e2b_env: dict[str, str]) -> None:
    url = e2b_env["E2B_API_URL"]
    with httpx.Client(headers={"X-API-KEY": KEY}, timeout=60) as http:
        for body in (b"{", b"[]", b'{"templateID": 5}', b'{"templateID": "base", "timeout": -1}'):
            reply = http.post(f"{url}/v2/sandboxes", content=body)
            assert reply.status_code == 400, body
            assert set(reply.json()) == {"code", "message"} and reply.json()["code"] == 400
        reply = http.post(f"{url}/v2/sandboxes", json={"templateID": "no-such-template"})
        assert reply.status_code in (400, 404) and "no-such-template" in reply.json()["message"]
        reply = http.get(f"{url}/v2/sandboxes", params={"state": "sleeping"})
        assert reply.status_code == 400
        reply = http.get(f"{url}/v2/sandboxes", params={"nextToken": "???"})
        assert reply.status_code == 400
        reply = http.get(f"{url}/sandboxes/nope")
        assert reply.status_code == 404 and set(reply.json()) == {"code", "message"}
        gone = http.get(
            f"{url}/health", headers={"E2b-Sandbox-Id": "nope", "E2b-Sandbox-Port": "49983"}
        )
        assert gone.status_code == 502 and "was not found" in gone.json()["message"]


def test_what_is_not_served_says_so(sbx: Sandbox) -> None:
    with pytest.raises(SandboxException, match="501: sandbox metrics"):
        sbx.get_metrics()
    with pytest.raises(SandboxException, match="400: mcp servers are not supported"):
        Sandbox.create(mcp={"exa": {"apiKey": "x"}})
    with pytest.raises(SandboxException, match="400: .*denyOut"):
        Sandbox.create(network={"deny_out": ["10.0.0.0/8"]})


def test_on_timeout_pause_pauses_and_connect_resumes(e2b_env: dict[str, str]) -> None:
    sandbox = Sandbox.create(timeout=2, lifecycle={"on_timeout": "pause"})
    try:
        sandbox.run_code("kept = 'after an auto-pause'")
        until(
            lambda: Sandbox.get_info(sandbox.sandbox_id).state == SandboxState.PAUSED,
            90,
            "the pause at its timeout",
        )
        back = Sandbox.connect(sandbox.sandbox_id, timeout=600)
        assert back.run_code("kept").text == "after an auto-pause"
    finally:
        Sandbox.kill(sandbox.sandbox_id)
