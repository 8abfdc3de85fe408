"""The client commands (`cloche run`, `repl`, `sessions`, `tool-schema`) as a user runs them:
subprocesses (the REPL in a pseudo-terminal) against a real gVisor server."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest

from support import ServerThread, make_config, require_gvisor

CLOCHE = Path(sys.executable).parent / "cloche"
TOKEN = "cli-token"
PROMPT = ">>> "
MORE = "... "


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    require_gvisor()
    state = tmp_path_factory.mktemp("cli-client-state")
    with ServerThread(make_config(state, tokens=frozenset({TOKEN}), pool_size=2)) as running:
        yield running


@pytest.fixture
def url(api: ServerThread) -> Iterator[str]:
    yield f"http://127.0.0.1:{api.http_port}"
    assert api.server.manager.list(TOKEN) == [], "a test left a session open"


@pytest.fixture
def environment(tmp_path: Path) -> dict[str, str]:
    """The caller's environment without CLOCHE_*, and a HOME of the test's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOCHE_")}
    env["HOME"] = str(tmp_path)
    env["CLOCHE_HISTORY"] = str(tmp_path / "history")
    return env


def cloche(
    *argv: str, env: dict[str, str], stdin: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLOCHE), *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        cwd=cwd,
    )


def connect(url: str) -> list[str]:
    return ["--url", url, "--token", TOKEN]


# cloche run


def test_run_streams_output_and_prints_the_result(url, environment, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\n6 * 7\n"
    )
    done = cloche("run", str(script), *connect(url), env=environment)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "to stdout\n42\n"
    assert done.stderr == "to stderr\n"


def test_run_reads_stdin_and_takes_the_server_from_the_environment(url, environment):
    environment.update(CLOCHE_URL=url, CLOCHE_TOKEN=TOKEN)
    done = cloche("run", "-", env=environment, stdin="print(sum(range(10)))")
    assert (done.returncode, done.stdout) == (0, "45\n"), done.stderr


def test_run_exits_1_with_the_traceback_when_the_code_fails(url, environment):
    done = cloche("run", "-", *connect(url), env=environment, stdin="print('ran')\n{}['missing']")
    assert done.returncode == 1
    assert done.stdout == "ran\n"
    assert "KeyError: 'missing'" in done.stderr
    assert "Traceback" in done.stderr


def test_run_exits_1_when_the_cell_times_out(url, environment):
    done = cloche(
        "run", "-", "--timeout", "1", *connect(url), env=environment, stdin="while True: pass"
    )
    assert done.returncode == 1
    assert "time limit" in done.stderr


def test_run_keep_leaves_the_session_open_for_later(url, environment, api):
    done = cloche("run", "-", "--keep", *connect(url), env=environment, stdin="answer = 42")
    assert done.returncode == 0, done.stderr
    match = re.fullmatch(r"cloche: kept session ([0-9a-f-]{36})\n", done.stderr)
    assert match, done.stderr
    session_id = match[1]
    again = cloche(
        "run", "-", "--session", session_id, *connect(url), env=environment, stdin="answer + 1"
    )
    assert (again.returncode, again.stdout) == (0, "43\n"), again.stderr

    listed = cloche("sessions", *connect(url), env=environment)
    assert listed.returncode == 0
    assert session_id in listed.stdout and "lean" in listed.stdout

    shown = cloche("sessions", "show", session_id, "--json", *connect(url), env=environment)
    assert shown.returncode == 0, shown.stderr
    described = json.loads(shown.stdout)
    assert (described["id"], described["execution_count"]) == (session_id, 2)

    closed = cloche("sessions", "close", session_id, *connect(url), env=environment)
    assert (closed.returncode, closed.stdout) == (0, f"closed {session_id}\n")
    gone = cloche("sessions", "show", session_id, *connect(url), env=environment)
    assert gone.returncode == 2
    assert gone.stderr == f"cloche sessions show: Session {session_id} not found\n"
    assert cloche("sessions", "--json", *connect(url), env=environment).stdout.strip() == "[]"


def test_run_a_missing_file(url, environment, tmp_path):
    done = cloche("run", str(tmp_path / "absent.py"), *connect(url), env=environment)
    assert done.returncode == 2 and "can't read" in done.stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_no_server_names_the_url_setting(environment):
    done = cloche(
        "run", "-", "--url", f"http://127.0.0.1:{free_port()}", env=environment, stdin="1"
    )
    assert done.returncode == 2
    assert "can't reach a cloche server" in done.stderr
    assert "--url" in done.stderr and "CLOCHE_URL" in done.stderr


def test_no_token_names_the_token_setting(url, environment):
    done = cloche("sessions", "--url", url, env=environment)
    assert done.returncode == 2
    assert "needs a token" in done.stderr
    assert "--token" in done.stderr and "CLOCHE_TOKEN" in done.stderr


def test_options_may_follow_the_subcommand_or_precede_it(url, environment):
    after = cloche("sessions", "list", "--json", *connect(url), env=environment)
    before = cloche("sessions", *connect(url), "--json", "list", env=environment)
    assert after.returncode == before.returncode == 0, after.stderr + before.stderr
    assert json.loads(after.stdout) == json.loads(before.stdout) == []


# cloche tool-schema


def test_tool_schema_is_an_openai_function_definition(environment):
    done = cloche("tool-schema", env=environment)
    assert done.returncode == 0
    schema = json.loads(done.stdout)
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "run_python"
    assert "persist" in function["description"]
    assert function["parameters"]["required"] == ["code"]
    assert function["parameters"]["properties"]["code"]["type"] == "string"
    flat = json.loads(cloche("tool-schema", "--style", "responses", env=environment).stdout)
    assert flat["name"] == "run_python" and flat["parameters"] == function["parameters"]


# cloche repl, in a pseudo-terminal


def spawn_repl(
    url: str, environment: dict[str, str], *extra: str, cwd: Path
) -> tuple[pexpect.spawn, str]:
    """The REPL at its first prompt, and the id of its session."""
    repl = pexpect.spawn(
        str(CLOCHE),
        ["repl", *connect(url), *extra],
        env=environment,
        cwd=str(cwd),
        encoding="utf-8",
        timeout=30,
        dimensions=(40, 200),
        # Ctrl-C as in a terminal, even under a shell's background job that ignores SIGINT.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    repl.expect(r"session ([0-9a-f-]{36}) \(lean\)")
    session_id = str(repl.match[1])
    repl.expect_exact(PROMPT)
    return repl, session_id


def test_repl_multiline_input_ctrl_c_and_files(url, environment, tmp_path, api):
    repl, _ = spawn_repl(url, environment, cwd=tmp_path)
    try:
        # A definition over several lines, then its use.
        repl.sendline("def double(x):")
        repl.expect_exact(MORE)
        repl.sendline("    return 2 * x")
        repl.expect_exact(MORE)
        repl.sendline("")
        repl.expect_exact(PROMPT)
        repl.sendline("double(21)")
        repl.expect_exact("42")
        repl.expect_exact(PROMPT)

        # Ctrl-C during a cell interrupts it; the session and its state live on.
        repl.sendline("marker = 'ali' + 've'")
        repl.expect_exact(PROMPT)
        repl.sendline("import time; print('sleep' + 'ing', flush=True); time.sleep(30)")
        repl.expect_exact("sleeping")
        repl.sendcontrol("c")
        repl.expect_exact("KeyboardInterrupt", timeout=20)  # well before the 30 s
        repl.expect_exact(PROMPT)
        repl.sendline("marker")
        repl.expect_exact("'alive'")
        repl.expect_exact(PROMPT)

        # Ctrl-C at the prompt drops the line being typed. (Once readline has echoed the
        # line it is waiting for more; a signal that comes while it is still busy with the
        # keys is only noticed at the next one, as in Python's own REPL.)
        repl.send("unfinished(")
        repl.expect_exact("unfinished(")
        repl.sendcontrol("c")
        repl.expect_exact("KeyboardInterrupt")
        repl.expect_exact(PROMPT)
        repl.sendline("double(50)")
        repl.expect_exact("100")
        repl.expect_exact(PROMPT)

        # %upload and %download.
        (tmp_path / "local.txt").write_text("from the host\n")
        repl.sendline("%upload local.txt inside/remote.txt")
        repl.expect_exact("uploaded local.txt to inside/remote.txt (14 bytes)")
        repl.expect_exact(PROMPT)
        repl.sendline("open('inside/remote.txt').read().upper()")
        repl.expect_exact("'FROM THE HOST\\n'")
        repl.expect_exact(PROMPT)
        repl.sendline("open('made.txt', 'w').write('made ' * 3)")
        repl.expect_exact("15")
        repl.expect_exact(PROMPT)
        repl.sendline("%download made.txt back.txt")
        repl.expect_exact("downloaded made.txt to back.txt (15 bytes)")
        repl.expect_exact(PROMPT)
        assert (tmp_path / "back.txt").read_text() == "made made made "

        # An error is shown, and the prompt comes back.
        repl.sendline("1 / 0")
        repl.expect_exact("ZeroDivisionError: division by zero")
        repl.expect_exact(PROMPT)

        repl.sendeof()
        repl.expect(r"closed session [0-9a-f-]{36}")
        repl.expect(pexpect.EOF)
    finally:
        repl.close(force=True)
    assert repl.exitstatus == 0
    assert api.server.manager.list(TOKEN) == []
    history = (tmp_path / "history").read_text()
    assert "double(21)" in history and "%upload local.txt inside/remote.txt" in history


def test_repl_attaches_to_an_existing_session_and_leaves_it_open(url, environment, tmp_path, api):
    made = cloche("run", "-", "--keep", *connect(url), env=environment, stdin="earlier = 'kept'")
    session_id = made.stderr.split()[-1]
    repl, attached = spawn_repl(url, environment, "--session", session_id, cwd=tmp_path)
    try:
        assert attached == session_id
        repl.sendline("earlier")
        repl.expect_exact("'kept'")
        repl.expect_exact(PROMPT)
        repl.sendline("%session")
        repl.expect_exact(session_id)
        repl.expect_exact(PROMPT)  # the EOF must reach the prompt, not the line before it
        repl.sendeof()
        repl.expect_exact(f"cloche repl --session {session_id}")
        repl.expect(pexpect.EOF)
    finally:
        repl.close(force=True)
    assert repl.exitstatus == 0
    assert [info.id for info in api.server.manager.list(TOKEN)] == [session_id]
    assert cloche("sessions", "close", session_id, *connect(url), env=environment).returncode == 0


def test_sessions_snapshot_fork_pause_resume_and_snapshots(url, environment, api):
    made = cloche("run", "-", "--keep", *connect(url), env=environment, stdin="v = 'kept'")
    session_id = re.fullmatch(r"cloche: kept session ([0-9a-f-]{36})\n", made.stderr)[1]  # type: ignore[index]

    snap = cloche(
        "sessions", "snapshot", session_id, "--name", "s1", "--json", *connect(url), env=environment
    )
    assert snap.returncode == 0, snap.stderr
    snapshot = json.loads(snap.stdout)
    assert (snapshot["session_id"], snapshot["name"]) == (session_id, "s1")
    listed = cloche("snapshots", *connect(url), env=environment)
    assert snapshot["id"] in listed.stdout and "s1" in listed.stdout

    forked = cloche("sessions", "fork", session_id, "-n", "2", *connect(url), env=environment)
    assert forked.returncode == 0, forked.stderr
    copies = forked.stdout.split()
    assert len(copies) == 2 and session_id not in copies

    paused = cloche("sessions", "pause", session_id, *connect(url), env=environment)
    assert (paused.returncode, paused.stdout) == (0, f"paused {session_id}\n"), paused.stderr
    shown = cloche("sessions", "show", session_id, "--json", *connect(url), env=environment)
    assert json.loads(shown.stdout)["state"] == "paused"
    resumed = cloche("sessions", "resume", session_id, *connect(url), env=environment)
    assert resumed.returncode == 0, resumed.stderr
    for sid in (session_id, *copies):
        ran = cloche("run", "-", "--session", sid, *connect(url), env=environment, stdin="v")
        assert (ran.returncode, ran.stdout) == (0, "'kept'\n"), ran.stderr

    deleted = cloche("snapshots", "delete", snapshot["id"], *connect(url), env=environment)
    assert deleted.stdout == f"deleted {snapshot['id']}\n"
    assert cloche("snapshots", "--json", *connect(url), env=environment).stdout.strip() == "[]"
    closed = cloche("sessions", "close", session_id, *copies, *connect(url), env=environment)
    assert closed.returncode == 0, closed.stderr


def test_sessions_create_label_list_by_metadata_and_history(url, environment):
    made = cloche(
        "sessions", "create", "--metadata", "agent=planner", "--metadata", "run=42",
        *connect(url), env=environment,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    planner = made.stdout.strip()
    other = cloche(
        "sessions", "create", "--metadata", "run=43", "--json", *connect(url), env=environment
    )
    assert other.returncode == 0, other.stderr
    described = json.loads(other.stdout)
    coder = described["id"]
    assert described["metadata"] == {"run": "43"}
    try:
        listed = cloche("sessions", "list", "--filter", "run=42", *connect(url), env=environment)
        assert listed.returncode == 0, listed.stderr
        assert planner in listed.stdout and coder not in listed.stdout
        assert re.search(rf"^{planner} .* agent=planner,run=42$", listed.stdout, re.M), (
            listed.stdout
        )

        labelled = cloche(
            "sessions", "label", coder, "run=42", "agent=coder", *connect(url), env=environment
        )
        assert (labelled.returncode, labelled.stdout) == (0, "run=42\nagent=coder\n"), (
            labelled.stderr
        )

        def ids(*filters: str) -> set[str]:
            done = cloche("sessions", "--json", *filters, *connect(url), env=environment)
            assert done.returncode == 0, done.stderr
            return {info["id"] for info in json.loads(done.stdout)}

        assert ids("--filter", "run=42") == {planner, coder}
        assert ids("--filter", "run=42", "--filter", "agent=coder") == {coder}
        assert ids("--state", "idle", "--profile", "lean") == {planner, coder}
        assert ids("--state", "paused") == set()
        deleted = cloche("sessions", "label", coder, "agent=", *connect(url), env=environment)
        assert (deleted.returncode, deleted.stdout) == (0, "run=42\n"), deleted.stderr
        assert ids("--filter", "agent=coder") == set()
        shown = cloche("sessions", "show", planner, *connect(url), env=environment)
        assert "metadata   agent=planner" in shown.stdout and "metadata   run=42" in shown.stdout

        ran = cloche(
            "run", "-", "--session", planner, *connect(url), env=environment,
            stdin="print('hello')\nprint('again')\n6 * 7",
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        failed = cloche(
            "run", "-", "--session", planner, *connect(url), env=environment, stdin="1 / 0"
        )
        assert failed.returncode == 1
        history = cloche("sessions", "history", planner, *connect(url), env=environment)
        assert history.returncode == 0, history.stderr
        lines = history.stdout.splitlines()
        assert lines[0].split() == ["CELL", "ENDED", "TIME", "FROM", "CODE"]
        assert re.fullmatch(
            r"\s+1  ok\s+\d+ ms  http\s+print\('hello'\) \.\.\. \(\+2 lines\)", lines[1]
        )
        assert lines[2:4] == ["       stdout: hello ... (+1 line)", "       result: 42"]
        assert re.fullmatch(r"\s+2  error\s+\d+ ms  http\s+1 / 0", lines[4])
        assert lines[5:] == ["       error: ZeroDivisionError: division by zero"]

        second = cloche(
            "sessions", "history", planner, "--after", "1", "--json", *connect(url), env=environment
        )
        (cell,) = json.loads(second.stdout)
        assert (cell["number"], cell["code"], cell["end_reason"]) == (2, "1 / 0", "error")
        assert cell["error"]["ename"] == "ZeroDivisionError" and cell["front_end"] == "http"
        first = cloche(
            "sessions", "history", planner, "--limit", "1", "--json", *connect(url), env=environment
        )
        assert [c["result"] for c in json.loads(first.stdout)] == [{"text/plain": "42"}]
        empty = cloche("sessions", "history", coder, *connect(url), env=environment)
        assert (empty.returncode, empty.stdout) == (0, "no cells\n")
    finally:
        closed = cloche("sessions", "close", planner, coder, *connect(url), env=environment)
        assert closed.returncode == 0, closed.stderr
    gone = cloche("sessions", "history", planner, *connect(url), env=environment)
    assert gone.returncode == 2
    assert gone.stderr == f"cloche sessions history: Session {planner} not found\n"
    bad = cloche("sessions", "label", planner, "no-equals", *connect(url), env=environment)
    assert bad.returncode == 2 and "expected KEY=VALUE" in bad.stderr


def test_bad_metadata_is_refused_with_the_servers_reason(url, environment):
    pairs = [arg for i in range(33) for arg in ("--metadata", f"k{i}=v")]
    refused = cloche("sessions", "create", *pairs, *connect(url), env=environment)
    assert refused.returncode == 2
    assert refused.stderr.startswith("cloche sessions create: metadata has 33 pairs")
