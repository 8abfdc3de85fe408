"""Commands of a session (`/v1/sessions/{id}/commands`) over HTTP, against real gVisor:
exit codes, streams kept apart and streamed as they happen, timeouts of whole process
trees, background commands with stdin, listing, attaching, signals and kills, a client
that leaves killing its command, and the filesystem shared with cells."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import ServerThread, make_config, require_gvisor, sse_events

T1 = {"Authorization": "Bearer t1"}
T2 = {"Authorization": "Bearer t2"}


@pytest.fixture(scope="module")
def server(state_root) -> Iterator[ServerThread]:
    require_gvisor()
    with ServerThread(make_config(state_root, tokens=frozenset({"t1", "t2"}))) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    base = f"http://127.0.0.1:{server.http_port}"
    with httpx.Client(base_url=base, headers=T1, timeout=120) as client:
        yield client


@pytest.fixture
def session(http: httpx.Client) -> Iterator[str]:
    reply = http.post("/v1/sessions", json={})
    assert reply.status_code == 201, reply.text
    yield reply.json()["id"]
    http.delete(f"/v1/sessions/{reply.json()['id']}")


def run(http: httpx.Client, session: str, **body: object) -> dict:
    reply = http.post(f"/v1/sessions/{session}/commands", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def processes(http: httpx.Client, session: str) -> list[str]:
    """The command lines of every process in the session's sandbox (seen from a cell)."""
    code = (
        "import os\n"
        "found = []\n"
        "for p in os.listdir('/proc'):\n"
        "    try: found.append(open(f'/proc/{p}/cmdline','rb').read().replace(b'\\0',b' ')"
        ".decode())\n"
        "    except OSError: pass\n"
        "found"
    )
    reply = http.post(f"/v1/sessions/{session}/execute", json={"code": code})
    assert reply.status_code == 200, reply.text
    return reply.json()["result_json"]


def wait_until(check, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_exit_codes_and_streams_apart(http, session):
    done = run(http, session, cmd="echo out; echo err >&2; exit 3")
    assert (done["exit_code"], done["status"], done["end_reason"]) == (3, "exited", "error")
    assert (done["stdout"], done["stderr"]) == ("out\n", "err\n")
    ok = run(http, session, cmd="printf", args=["%s-%s", "a b", "$HOME"])
    assert (ok["exit_code"], ok["stdout"], ok["end_reason"]) == (0, "a b-$HOME", "ok")
    missing = run(http, session, cmd="no-such-program-here", args=[])
    assert missing["exit_code"] == 127 and "no-such-program-here" in missing["stderr"]
    where = run(http, session, cmd="id -un; pwd; echo $HOME")
    assert where["stdout"] == "user\n/home/user\n/home/user\n"


def test_a_command_runs_under_a_leader_of_its_session_as_the_user_where_asked(http, session):
    probe = (
        "import os; print(os.getsid(0) == os.getpgid(0) == os.getppid() != os.getpid(), "
        "os.getcwd())"
    )
    led = run(http, session, cmd="exec python3 -c " + repr(probe), cwd="/tmp")
    assert (led["exit_code"], led["stdout"]) == (0, "True /tmp\n")
    # Its ids are the user's through and through (real, effective and saved), as root's
    # are root's; the supervisor that started both is root still.
    ids = "exec python3 -c 'import os; print(os.getresuid(), os.getresgid())'"
    assert run(http, session, cmd=ids)["stdout"] == "(1000, 1000, 1000) (1000, 1000, 1000)\n"
    assert run(http, session, cmd=ids, user="root")["stdout"] == "(0, 0, 0) (0, 0, 0)\n"
    assert run(http, session, cmd=ids)["stdout"] == "(1000, 1000, 1000) (1000, 1000, 1000)\n"
    # Not a group leader itself: a command that makes a session of its own (as agent
    # frameworks do, `setsid sh -c ...`) keeps its exit code and output.
    done = run(http, session, cmd="setsid sh -c 'echo inside; exit 7'")
    assert (done["exit_code"], done["stdout"]) == (7, "inside\n")
    # Where it can't start (no such program, a directory it may not enter) it says why.
    missing = run(http, session, cmd="/no/such/program", args=[])
    assert (missing["exit_code"], missing["stderr"]) == (
        127,
        "cloche: cannot run '/no/such/program': No such file or directory\n",
    )
    closed = run(http, session, cmd="mkdir -p -m 700 /srv/closed", user="root")
    assert closed["exit_code"] == 0, closed
    shut = run(http, session, cmd="true", args=[], cwd="/srv/closed")
    assert shut["exit_code"] == 126 and "working directory '/srv/closed'" in shut["stderr"]
    assert run(http, session, cmd="pwd", cwd="/srv/closed", user="root")["stdout"] == (
        "/srv/closed\n"
    )


def test_output_streams_as_it_happens(http, session):
    body = {
        "cmd": "echo first; while [ ! -e /home/user/go ]; do sleep 0.05; done; echo second >&2",
    }
    with http.stream(
        "POST",
        f"/v1/sessions/{session}/commands",
        json=body,
        headers={"Accept": "text/event-stream"},
    ) as response:
        assert response.status_code == 200
        events = sse_events(response)
        kind, data = next(events)
        assert kind == "start" and isinstance(data["pid"], int)
        assert next(events) == ("stdout", {"data": "first\n"})
        # Only now, with "first" already here, is the command let go on.
        put = http.put(f"/v1/sessions/{session}/files/go", content=b"")
        assert put.status_code in (200, 201, 204), put.text
        assert next(events) == ("stderr", {"data": "second\n"})
        kind, end = next(events)
    assert kind == "end" and end["exit_code"] == 0 and end["status"] == "exited"


def test_a_timeout_kills_the_whole_process_tree(http, session):
    done = run(
        http,
        session,
        cmd="sleep 1001 & setsid sleep 1002 & echo started; wait",
        timeout=1,
    )
    assert (done["status"], done["end_reason"], done["exit_code"]) == ("timeout", "timeout", None)
    assert done["stdout"] == "started\n"
    wait_until(lambda: not any("sleep 100" in p for p in processes(http, session)))


def test_background_commands_are_listed_take_stdin_and_end(http, session):
    started = http.post(
        f"/v1/sessions/{session}/commands",
        json={"cmd": "cat", "args": [], "stdin": True, "background": True, "tag": "echoer"},
    )
    assert started.status_code == 201, started.text
    pid = started.json()["pid"]
    listed = http.get(f"/v1/sessions/{session}/commands").json()["commands"]
    assert [(c["pid"], c["tag"], c["cmd"]) for c in listed] == [(pid, "echoer", "cat")]
    # Cells run meanwhile, in the same sandbox.
    cell = http.post(f"/v1/sessions/{session}/execute", json={"code": "6 * 7"}).json()
    assert cell["result_json"] == 42
    with http.stream("GET", f"/v1/sessions/{session}/commands/{pid}") as attached:
        assert attached.status_code == 200
        events = sse_events(attached)
        sent = http.post(f"/v1/sessions/{session}/commands/{pid}/stdin", json={"data": "hi\n"})
        assert sent.status_code == 204, sent.text
        assert next(events) == ("stdout", {"data": "hi\n"})
        eof = http.post(f"/v1/sessions/{session}/commands/{pid}/stdin", json={"eof": True})
        assert eof.status_code == 204
        kind, end = next(events)
    assert kind == "end" and (end["exit_code"], end["status"]) == (0, "exited")
    assert http.get(f"/v1/sessions/{session}/commands").json()["commands"] == []
    gone = http.post(f"/v1/sessions/{session}/commands/{pid}/stdin", json={"data": "x"})
    assert gone.status_code == 404 and "not running" in gone.json()["error"]["message"]


def test_signals_and_kills(http, session):
    first = http.post(
        f"/v1/sessions/{session}/commands",
        json={
            "cmd": "trap 'echo got TERM; exit 5' TERM; touch trapped; while :; do sleep 0.05; done",
            "background": True,
        },
    ).json()["pid"]
    wait_until(lambda: http.get(f"/v1/sessions/{session}/files/trapped").status_code == 200)
    with http.stream("GET", f"/v1/sessions/{session}/commands/{first}") as attached:
        events = sse_events(attached)
        signalled = http.post(
            f"/v1/sessions/{session}/commands/{first}/signal", json={"signal": "SIGTERM"}
        )
        assert signalled.status_code == 204, signalled.text
        seen = list(events)  # the group's sleep may say "Terminated" on stderr first
    assert ("stdout", {"data": "got TERM\n"}) in seen
    assert seen[-1][0] == "end" and seen[-1][1]["exit_code"] == 5
    second = http.post(
        f"/v1/sessions/{session}/commands",
        json={"cmd": "sleep 1003 & sleep 1004", "background": True},
    ).json()["pid"]
    assert http.delete(f"/v1/sessions/{session}/commands/{second}").status_code == 204
    wait_until(lambda: not any("sleep 100" in p for p in processes(http, session)))
    assert http.delete(f"/v1/sessions/{session}/commands/{second}").status_code == 404
    bad = http.post(f"/v1/sessions/{session}/commands/{second}/signal", json={"signal": "NOPE"})
    assert bad.status_code == 400 and "NOPE" in bad.json()["error"]["message"]


def test_a_client_leaving_a_foreground_stream_kills_its_command(http, session):
    with http.stream(
        "POST",
        f"/v1/sessions/{session}/commands?stream=true",
        json={"cmd": "echo ready; exec sleep 1005"},
    ) as response:
        events = sse_events(response)
        assert next(events)[0] == "start"
        assert next(events) == ("stdout", {"data": "ready\n"})
    wait_until(lambda: not any("sleep 1005" in p for p in processes(http, session)))
    wait_until(lambda: http.get(f"/v1/sessions/{session}/commands").json()["commands"] == [])


def test_cells_and_commands_share_the_filesystem(http, session):
    cell = http.post(
        f"/v1/sessions/{session}/execute",
        json={"code": "open('from-cell.txt', 'w').write('written by a cell')"},
    )
    assert cell.status_code == 200
    assert run(http, session, cmd="cat from-cell.txt")["stdout"] == "written by a cell"
    run(http, session, cmd="echo written by a command > /tmp/from-command.txt")
    read = http.post(
        f"/v1/sessions/{session}/execute",
        json={"code": "open('/tmp/from-command.txt').read()"},
    ).json()
    assert read["result_json"] == "written by a command\n"


def test_commands_are_in_the_history_and_another_tenant_sees_nothing(server, http, session):
    run(http, session, cmd="echo kept; exit 2")
    cells = http.get(f"/v1/sessions/{session}/cells").json()["cells"]
    last = cells[-1]
    assert (last["kind"], last["code"], last["exit_code"], last["stdout"]) == (
        "command",
        "echo kept; exit 2",
        2,
        "kept\n",
    )
    base = f"http://127.0.0.1:{server.http_port}"
    with httpx.Client(base_url=base, headers=T2, timeout=60) as other:
        assert (
            other.post(f"/v1/sessions/{session}/commands", json={"cmd": "true"}).status_code == 404
        )
        assert other.get(f"/v1/sessions/{session}/commands").status_code == 404


def test_bad_commands_get_clear_errors(http, session):
    for body, words in (
        ({}, "cmd"),
        ({"cmd": ""}, "cmd"),
        ({"cmd": "true", "shell": True}, "shell"),
        ({"cmd": "true", "user": "nobody-here"}, "nobody-here"),
        ({"cmd": "true", "cwd": "/no/such/dir"}, None),
    ):
        reply = http.post(f"/v1/sessions/{session}/commands", json=body)
        if words is None:  # the directory is the command's: it fails inside, with a message
            assert reply.status_code == 200 and "/no/such/dir" in reply.json()["stderr"]
            continue
        assert reply.status_code == 400, (body, reply.text)
        assert words in reply.json()["error"]["message"], reply.text
    unknown = http.post("/v1/sessions/no-such-session/commands", json={"cmd": "true"})
    assert unknown.status_code == 404


def test_background_commands_come_back_with_a_resumed_session_and_in_forks(http, session):
    pid = http.post(
        f"/v1/sessions/{session}/commands",
        json={
            "cmd": "while :; do date +%s%N >> ticks; sleep 0.05; done",
            "background": True,
            "tag": "ticker",
        },
    ).json()["pid"]
    assert http.post(f"/v1/sessions/{session}/pause").status_code == 200
    assert http.get(f"/v1/sessions/{session}").json()["state"] == "paused"
    listed = http.get(f"/v1/sessions/{session}/commands").json()["commands"]  # resumes it
    assert [(c["pid"], c["tag"]) for c in listed] == [(pid, "ticker")]

    def ticks(where: str) -> int:
        return len(http.get(f"/v1/sessions/{where}/files/ticks").content.splitlines())

    before = ticks(session)
    wait_until(lambda: ticks(session) > before)  # it runs on after the resume
    copies = http.post(f"/v1/sessions/{session}/fork", json={"count": 1}).json()["sessions"]
    copy = copies[0]["id"]
    try:
        listed = http.get(f"/v1/sessions/{copy}/commands").json()["commands"]
        assert [(c["pid"], c["tag"]) for c in listed] == [(pid, "ticker")]
        before = ticks(copy)
        wait_until(lambda: ticks(copy) > before)
        assert http.delete(f"/v1/sessions/{copy}/commands/{pid}").status_code == 204
        wait_until(lambda: http.get(f"/v1/sessions/{copy}/commands").json()["commands"] == [])
        # The original's goes on: the copy's kill was the copy's.
        assert [
            c["pid"] for c in http.get(f"/v1/sessions/{session}/commands").json()["commands"]
        ] == [pid]
    finally:
        http.delete(f"/v1/sessions/{copy}")
    # Its end is in the original's history once killed there.
    assert http.delete(f"/v1/sessions/{session}/commands/{pid}").status_code == 204

    def recorded() -> bool:
        cells = http.get(f"/v1/sessions/{session}/cells").json()["cells"]
        return any(c["kind"] == "command" and c["code"].startswith("while") for c in cells)

    wait_until(recorded)


def command_ends(http: httpx.Client, reason: str) -> float:
    """cloche_command_ends_total{end_reason=reason}, summed over nodes (a cluster's)."""
    total = 0.0
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if (
                sample.name == "cloche_command_ends_total"
                and sample.labels.get("end_reason") == reason
            ):
                total += sample.value
    return total


def test_command_ends_are_counted_by_reason(http, session):
    before = command_ends(http, "error"), command_ends(http, "timeout")
    run(http, session, cmd="exit 9")
    run(http, session, cmd="sleep 30", timeout=0.5)
    wait_until(
        lambda: (
            (command_ends(http, "error"), command_ends(http, "timeout"))
            == (before[0] + 1, before[1] + 1)
        )
    )


def test_a_background_start_asked_as_events_streams_from_its_first_byte(http, session):
    with http.stream(
        "POST",
        f"/v1/sessions/{session}/commands",
        json={"cmd": "echo early; exec sleep 1007", "background": True},
        headers={"Accept": "text/event-stream"},
    ) as response:
        assert response.status_code == 200
        events = sse_events(response)
        kind, started = next(events)
        assert kind == "start" and isinstance(started["pid"], int)
        assert next(events) == ("stdout", {"data": "early\n"})
    # Leaving the stream only stopped listening: it runs on.
    listed = http.get(f"/v1/sessions/{session}/commands").json()["commands"]
    assert [c["pid"] for c in listed] == [started["pid"]]
    assert http.delete(f"/v1/sessions/{session}/commands/{started['pid']}").status_code == 204
    wait_until(lambda: http.get(f"/v1/sessions/{session}/commands").json()["commands"] == [])


def test_a_kill_asked_as_the_sandbox_dies_is_told_the_session_is_gone(server, http, session):
    """The supervisor is stopped (as root), so a kill waits for its answer; the sandbox then
    dies under it. The kill is told what a request to a dead session is told (404, with how
    it died), not that the process could not be reached (400): there is nothing to kill."""
    sleeper = http.post(
        f"/v1/sessions/{session}/commands", json={"cmd": "sleep 600", "background": True}
    ).json()["pid"]
    found = http.post(
        f"/v1/sessions/{session}/execute",
        json={
            "code": "import os\n"
            "ours = {int(p): int(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1])\n"
            "        for p in os.listdir('/proc') if p.isdigit()\n"
            "        and b'procd.run' in open(f'/proc/{p}/cmdline', 'rb').read()}\n"
            "[pid for pid, parent in ours.items() if parent not in ours]"  # not its spare
        },
    ).json()["result_json"]
    assert len(found) == 1, found
    supervisor = found[0]
    stopper = {"cmd": f"kill -STOP {supervisor}", "user": "root", "background": True}
    assert http.post(f"/v1/sessions/{session}/commands", json=stopper).status_code == 201
    state = f"open('/proc/{supervisor}/stat').read().rsplit(')', 1)[1].split()[0]"

    def stopped() -> bool:
        reply = http.post(f"/v1/sessions/{session}/execute", json={"code": state})
        return reply.json()["result_json"] == "T"

    wait_until(stopped)
    kernel = server.server.manager._sessions[session].kernel
    with ThreadPoolExecutor(1) as pool:
        kill = pool.submit(http.delete, f"/v1/sessions/{session}/commands/{sleeper}")
        wait_until(lambda: kernel.processes.asking)
        died = http.post(f"/v1/sessions/{session}/execute", json={"code": "import os; os._exit(3)"})
        assert died.json()["session_alive"] is False, died.text
        killed = kill.result(timeout=60)
    assert killed.status_code == 404, killed.text
    message = killed.json()["error"]["message"]
    assert message.startswith(f"Session {session} is gone: ") and "exit" in message, message
