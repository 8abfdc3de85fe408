"""`cloche exec`, `cloche shell` and `--template`/`--env` on the commands that make sessions,
as a user runs them: subprocesses (the shell in a pseudo-terminal, under pexpect) against a
real gVisor server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pexpect
import pytest

from support import ServerThread, make_config, require_gvisor

CLOCHE = Path(sys.executable).parent / "cloche"
TOKEN = "computer-token"
WAIT_S = 60  # a busy 2-core machine


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    require_gvisor()
    state = tmp_path_factory.mktemp("cli-computer-state")
    with ServerThread(make_config(state, tokens=frozenset({TOKEN}), pool_size=2)) as running:
        yield running


@pytest.fixture(scope="module")
def url(api: ServerThread) -> str:
    return f"http://127.0.0.1:{api.http_port}"


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        yield client


@pytest.fixture
def session(http: httpx.Client, api: ServerThread) -> Iterator[str]:
    made = http.post("/v1/sessions", json={})
    assert made.status_code == 201, made.text
    yield made.json()["id"]
    http.delete(f"/v1/sessions/{made.json()['id']}")
    assert api.server.manager.list(TOKEN) == [], "a test left a session open"


@pytest.fixture
def environment(tmp_path: Path) -> dict[str, str]:
    """The caller's environment without CLOCHE_*, and a HOME of the test's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOCHE_")}
    env["HOME"] = str(tmp_path)
    return env


def cloche(
    *argv: str, env: dict[str, str], stdin: bytes | None = None, url: str
) -> subprocess.CompletedProcess[bytes]:
    first, *rest = argv  # the server's options before any `--`
    return subprocess.run(
        [str(CLOCHE), first, "--url", url, "--token", TOKEN, *rest],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
        env=env,
    )


# cloche exec


def test_exec_keeps_the_streams_apart_and_passes_the_exit_status(url, session, environment):
    done = cloche(
        "exec",
        session,
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2; exit 3",
        env=environment,
        url=url,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, b"out\n", b"err\n")
    line = cloche("exec", session, "--", "echo $((6*7)) | tr 4 x", env=environment, url=url)
    assert (line.returncode, line.stdout) == (0, b"x2\n")  # one argument: a shell's line


def test_exec_passes_a_signal_s_status_as_a_shell_does(url, session, environment):
    done = cloche("exec", session, "--", "sh", "-c", "kill -TERM $$", env=environment, url=url)
    assert done.returncode == 128 + 15
    slow = cloche("exec", session, "--timeout", "1", "--", "sleep 30", env=environment, url=url)
    assert slow.returncode == 128 + 9 and b"time limit of 1 s" in slow.stderr


def test_exec_passes_piped_input_through_byte_for_byte(url, session, environment):
    assert cloche("exec", session, "--", "cat", env=environment, url=url, stdin=b"hi\n").stdout == (
        b"hi\n"
    )
    blob = bytes(range(256)) * 4096  # 1 MiB, not UTF-8
    copied = cloche("exec", session, "--", "cat", env=environment, url=url, stdin=blob)
    assert copied.returncode == 0 and copied.stdout == blob
    counted = cloche("exec", session, "--", "wc -c", env=environment, url=url, stdin=blob)
    assert counted.stdout.strip() == str(len(blob)).encode()


def test_exec_takes_user_directory_and_environment(url, session, environment):
    done = cloche(
        "exec",
        session,
        "--user",
        "root",
        "--cwd",
        "/tmp",
        "--env",
        "GREETING=hello there",
        "--",
        "sh",
        "-c",
        'id -u; pwd; echo "$GREETING"',
        env=environment,
        url=url,
    )
    assert (done.returncode, done.stdout) == (0, b"0\n/tmp\nhello there\n")


def test_exec_streams_output_as_it_comes(url, session, http, environment):
    running = subprocess.Popen(
        [
            str(CLOCHE),
            "exec",
            "--url",
            url,
            "--token",
            TOKEN,
            session,
            "--",
            "echo first; while [ ! -e go ]; do sleep 0.05; done; echo second",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        env=environment,
    )
    try:
        assert running.stdout is not None
        assert running.stdout.readline() == b"first\n"  # while the command waits
        assert running.poll() is None
        assert http.put(f"/v1/sessions/{session}/files/go", content=b"").status_code < 300
        assert running.stdout.read() == b"second\n"
        assert running.wait(WAIT_S) == 0
    finally:
        running.kill()
        running.wait()
        if running.stdout is not None:
            running.stdout.close()


def test_exec_in_an_unknown_session_says_so(url, environment):
    done = cloche("exec", "no-such-session", "--", "true", env=environment, url=url)
    assert done.returncode == 2 and b"no-such-session not found" in done.stderr


# cloche shell


def shell(url: str, session: str, tmp_path: Path, environment: dict[str, str]) -> pexpect.spawn:
    """`cloche shell` in a pseudo-terminal, between two saves of that terminal's settings
    and a line with its exit status."""
    line = (
        f"stty -g > {tmp_path}/before; {CLOCHE} shell {session} --url {url} --token {TOKEN}; "
        f'echo "status=$?"; stty -g > {tmp_path}/after'
    )
    child = pexpect.spawn(
        "/bin/sh", ["-c", line], env=environment, dimensions=(24, 80), timeout=WAIT_S
    )
    return child


def test_shell_answers_typed_input_takes_ctrl_c_follows_the_window_and_exits(
    url, session, tmp_path, environment
):
    child = shell(url, session, tmp_path, environment)
    try:
        child.sendline("echo $((6*7))X")
        child.expect("42X")
        # The marker comes from the foreground job itself: by then the shell has given it
        # the terminal, so the ^C below reaches it (typed earlier, it would reach the
        # shell, which waits on, and the sleep would run on).
        child.sendline("sh -c 'echo sleeping-$((1+1)); exec sleep 1000'")
        child.expect("sleeping-2")
        child.sendcontrol("c")  # raw mode: to the remote shell, which stops its sleep
        child.sendline("echo alive-$((2+3))")
        child.expect("alive-5")
        child.setwinsize(30, 100)  # SIGWINCH here: the remote terminal follows
        # The new size goes out when the client handles its SIGWINCH, which a line typed
        # at once may overtake on a loaded machine: ask until the remote side tells it.
        deadline = time.monotonic() + WAIT_S
        while True:
            child.sendline("stty size")
            if child.expect(["30 100", "24 80"]) == 0:
                break
            assert time.monotonic() < deadline, "the terminal never took the new size"
        child.sendline("exit 3")
        child.expect("status=3")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert (tmp_path / "after").read_text() == (tmp_path / "before").read_text()


def test_shell_restores_the_terminal_when_its_session_goes(
    url, session, http, tmp_path, environment
):
    child = shell(url, session, tmp_path, environment)
    try:
        child.sendline("echo here-$((3+4))")
        child.expect("here-7")
        assert http.delete(f"/v1/sessions/{session}").status_code == 204
        child.expect("status=2")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert (tmp_path / "after").read_text() == (tmp_path / "before").read_text()


def test_shell_of_an_unknown_session_says_so(url, tmp_path, environment):
    child = shell(url, "no-such-session", tmp_path, environment)
    try:
        child.expect("no-such-session not found")
        child.expect("status=2")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)


# --template and --env on the commands that make sessions


def test_sessions_are_made_of_a_template_with_an_environment(url, http, environment, api):
    made = cloche(
        "sessions",
        "create",
        "--template",
        "python",
        "--env",
        "COLOUR=teal",
        env=environment,
        url=url,
    )
    assert made.returncode == 0, made.stderr
    session = made.stdout.decode().strip()
    try:
        shown = cloche("sessions", "show", session, env=environment, url=url)
        assert b"template   python" in shown.stdout
        listed = cloche("sessions", "list", env=environment, url=url)
        assert b"TEMPLATE" in listed.stdout and session.encode() in listed.stdout
        said = cloche("exec", session, "--", "echo $COLOUR", env=environment, url=url)
        assert said.stdout == b"teal\n"
    finally:
        http.delete(f"/v1/sessions/{session}")
    ran = cloche(
        "run",
        "-",
        "--template",
        "python",
        "--env",
        "COLOUR=red",
        env=environment,
        url=url,
        stdin=b"import os\nos.environ['COLOUR']",
    )
    assert (ran.returncode, ran.stdout) == (0, b"'red'\n")
    refused = cloche("run", "-", "--template", "no-such", env=environment, url=url, stdin=b"1")
    assert refused.returncode == 2 and b"Template no-such not found" in refused.stderr
    assert api.server.manager.list(TOKEN) == []
