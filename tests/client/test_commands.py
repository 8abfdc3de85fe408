"""A session's commands and terminals through the SDK (`session.commands`, `session.pty()`),
blocking and async, against a real gVisor server: results, streaming to callbacks while the
command runs, stdin, check=True, background processes (list, attach, signal, kill, wait),
terminals (typed input, resize, the shell's exit status, refusals), and `template=` on
creation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import cloche

# Says it started, then waits until the test lets it go (a file appears in its home).
WAIT_FOR_GO = "echo waiting; while [ ! -e go ]; do sleep 0.05; done; echo released >&2; echo done"


def until(check, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def read_until(terminal: cloche.Terminal, wanted: bytes, timeout_s: float = 60.0) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout_s
    while wanted not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{wanted!r} not seen in {seen[-2000:]!r}"
        piece = terminal.read(timeout=left)
        assert piece, f"the terminal ended before {wanted!r}: {seen[-2000:]!r}"
        seen += piece
    return seen


def test_a_command_s_exit_code_and_streams_apart(session):
    done = session.commands.run("echo out; echo err >&2; exit 3")
    assert isinstance(done, cloche.CommandResult)
    assert (done.exit_code, done.status, done.end_reason, done.ok) == (3, "exited", "error", False)
    assert (done.stdout, done.stderr) == ("out\n", "err\n")
    assert done.pid > 0 and done.duration_ms > 0
    direct = session.commands.run("printf", args=["%s|%s", "a b", "$HOME"])
    assert (direct.exit_code, direct.stdout, direct.ok) == (0, "a b|$HOME", True)
    where = session.commands.run("pwd; echo $GREETING", cwd="/tmp", env={"GREETING": "hi"})
    assert where.stdout == "/tmp\nhi\n"
    assert session.commands.run("id -u", user="root").stdout == "0\n"


def test_check_raises_command_failed_only_when_asked(session):
    assert session.commands.run("exit 4").exit_code == 4  # data, without check
    with pytest.raises(cloche.CommandFailed) as failed:
        session.commands.run("echo no luck >&2; exit 4", check=True)
    assert failed.value.result.exit_code == 4
    assert failed.value.result.stderr == "no luck\n"
    assert str(failed.value) == "command 'echo no luck >&2; exit 4' exited with 4: no luck"
    assert isinstance(failed.value, cloche.ClocheError)
    with pytest.raises(cloche.CommandFailed) as timed_out:
        session.commands.run("sleep 30", timeout=1, check=True)
    assert timed_out.value.result.status == "timeout"
    assert session.commands.run("true", check=True).ok


def test_output_reaches_the_callbacks_while_the_command_runs(session):
    seen: list[tuple[str, str]] = []
    started = threading.Event()

    def on_stdout(text: str) -> None:
        seen.append(("stdout", text))
        if "waiting" in text:
            started.set()

    outcome: list[cloche.CommandResult] = []
    runner = threading.Thread(
        target=lambda: outcome.append(
            session.commands.run(
                WAIT_FOR_GO, on_stdout=on_stdout, on_stderr=lambda t: seen.append(("stderr", t))
            )
        )
    )
    runner.start()
    # The command can only end after this upload, which waits for its first line.
    assert started.wait(60), "the first line never came"
    assert outcome == []
    session.upload("go", b"")
    runner.join(60)
    (done,) = outcome
    assert "".join(t for name, t in seen if name == "stdout") == "waiting\ndone\n"
    assert "".join(t for name, t in seen if name == "stderr") == "released\n"
    assert (done.exit_code, done.stdout, done.stderr) == (0, "waiting\ndone\n", "released\n")


def test_stdin_is_written_then_closed(session):
    counted = session.commands.run("wc -c", stdin=b"x" * 200_000)
    assert counted.stdout.strip() == "200000"
    pieces = session.commands.run("cat", stdin=iter([b"one ", b"two ", b"three"]))
    assert pieces.stdout == "one two three"
    assert session.commands.run("cat", stdin="").stdout == ""


def test_a_background_process_is_listed_fed_waited_for(session):
    heard: list[str] = []
    process = session.commands.start("cat", stdin=True, tag="echoer", on_stdout=heard.append)
    assert isinstance(process, cloche.Process)
    listed = session.commands.list()
    assert [(p.pid, p.cmd, p.tag) for p in listed] == [(process.pid, "cat", "echoer")]
    assert session.run("6 * 7").text == "42"  # cells run meanwhile
    process.send_stdin("hello\n")
    until(lambda: "".join(heard) == "hello\n")
    process.send_stdin(b"\xff bytes\n")
    process.close_stdin()
    done = process.wait(timeout=60)
    assert (done.exit_code, done.status, done.end_reason) == (0, "exited", "ok")
    assert done.stdout == "hello\n\ufffd bytes\n"
    assert session.commands.list() == []


def test_signals_kills_and_waiting_with_a_deadline(session):
    trapping = session.commands.start(
        "trap 'echo got TERM; exit 5' TERM; while [ ! -e go ]; do sleep 0.05; done; "
        "echo ready; while :; do sleep 0.05; done"
    )
    trapping.attach()  # what it prints from now on is heard (and replayed to iterators)
    session.upload("go", b"")
    events = iter(trapping)
    assert next(events) == ("stdout", "ready\n")
    with pytest.raises(TimeoutError):
        trapping.wait(timeout=0.2)
    trapping.signal("TERM")
    rest = list(events)
    assert ("stdout", "got TERM\n") in rest
    assert trapping.wait().exit_code == 5
    sleeper = session.commands.start("sleep 1003 & sleep 1004", tag="napper")
    assert [p.tag for p in session.commands.list()] == ["napper"]
    sleeper.kill()
    ended = sleeper.wait(timeout=60)
    assert ended.exit_code is None and ended.status in ("signaled", "killed")
    until(lambda: session.commands.list() == [])
    with pytest.raises(cloche.ProcessNotFound):
        sleeper.kill()
    with pytest.raises(cloche.ProcessNotFound):
        session.commands.process(999_999).signal("TERM")


def test_refusals_are_the_tree_s_exceptions(client, session):
    elsewhere = session.commands.run("true", cwd="/no/such/dir")  # its own failure: data
    assert elsewhere.exit_code == 126 and "working directory" in elsewhere.stderr
    with pytest.raises(cloche.ProcessError, match="nobody-here"):
        session.commands.run("true", user="nobody-here")
    with pytest.raises(cloche.ProcessError, match="NOPE"):
        session.commands.start("sleep 1000").signal("NOPE")
    until(lambda: bool(session.commands.list()))
    for running in session.commands.list():
        session.commands.process(running.pid).kill()
    closed = client.create_session()
    closed.close()
    with pytest.raises(cloche.SessionNotFound):
        closed.commands.run("true")


def test_a_terminal_answers_typed_input_follows_a_resize_and_tells_the_exit(session):
    with session.pty(cols=100, rows=30) as terminal:
        assert isinstance(terminal, cloche.Terminal)
        terminal.write("echo $((6*7))X\r")
        read_until(terminal, b"42X")
        terminal.write(b"stty size\r")
        read_until(terminal, b"30 100")
        terminal.resize(132, 43)
        terminal.write("stty size\r")
        read_until(terminal, b"43 132")
        assert terminal.exit_code is None and not terminal.ended
        terminal.write("exit 3\r")
        assert terminal.wait(timeout=60) == 3
        assert terminal.ended and terminal.read() == b""
    until(lambda: session.commands.list() == [])


def test_a_quiet_terminal_s_read_times_out_and_a_command_may_run_in_one(session):
    with session.pty(cmd="read line; echo got-$line; exit 4") as terminal:
        with pytest.raises(TimeoutError):
            terminal.read(timeout=0.5)  # nothing to show yet: a deadline, not an end
        assert not terminal.ended
        terminal.write("it\r")
        read_until(terminal, b"got-it")
        assert terminal.wait(timeout=60) == 4


def test_a_terminal_of_a_closed_session_is_refused(client):
    session = client.create_session()
    session.close()
    terminal = session.pty()
    with pytest.raises(cloche.SessionNotFound):
        terminal.read(timeout=60)
    terminal.close()


def test_a_session_is_made_of_a_template(client):
    with client.create_session(template="python") as session:
        assert session.info.template == "python"
        assert client.get_session(session.id).template == "python"
    with pytest.raises(cloche.TemplateNotFound):
        client.create_session(template="no-such-template")


async def test_the_async_sdk_runs_starts_and_opens_terminals(url, token):
    async with cloche.AsyncClient(url, token) as client:
        async with await client.create_session() as session:
            chunks: list[str] = []

            async def collect(text: str) -> None:
                chunks.append(text)

            done = await session.commands.run("echo one; echo two", on_stdout=collect)
            assert "".join(chunks) == done.stdout == "one\ntwo\n"
            process = await session.commands.start(
                "while [ ! -e go ]; do sleep 0.05; done; echo ready; read line; echo got $line",
                stdin=True,
            )
            assert isinstance(process, cloche.AsyncProcess)
            await process.attach()
            await session.upload("go", b"")
            heard = []
            async for stream, text in process:
                heard.append((stream, text))
                if "".join(t for _, t in heard) == "ready\n":
                    await process.send_stdin("it\n")
            assert "".join(t for _, t in heard).endswith("got it\n")
            assert (await process.wait()).exit_code == 0
            async with await session.pty() as terminal:
                assert isinstance(terminal, cloche.AsyncTerminal)
                await terminal.write("echo $((7*6))Y\r")
                seen = b""
                async with asyncio.timeout(60):
                    while b"42Y" not in seen:
                        seen += await terminal.read()


def test_a_process_started_with_callbacks_is_heard_from_its_first_byte(session):
    heard: list[str] = []
    process = session.commands.start("echo first; exec sleep 1006", on_stdout=heard.append)
    assert process.pid > 0
    until(lambda: "".join(heard) == "first\n")
    assert [p.pid for p in session.commands.list()] == [process.pid]
    process.detach()  # stops listening: it runs on
    assert [p.pid for p in session.commands.list()] == [process.pid]
    process.kill()
    assert process.wait(timeout=60).status in ("signaled", "killed")
