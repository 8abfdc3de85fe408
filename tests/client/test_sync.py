"""The blocking SDK (cloche.Client, cloche.Session, cloche.run) against a real gVisor server."""

from __future__ import annotations

import signal
import threading
import time

import pytest

import cloche
from support import ServerThread

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOT = (
    "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
    "plt.plot([1, 3, 2])\n"
)
# A cell that says it started, then waits until the test lets it go (a file appears).
WAIT_FOR_GO = (
    "import os, sys, time\n"
    "print('waiting', flush=True)\n"
    "for _ in range(2000):\n"
    "    if os.path.exists('go'):\n"
    "        break\n"
    "    time.sleep(0.01)\n"
    "print('released', file=sys.stderr, flush=True)\n"
    "print('done', flush=True)\n"
    "'finished'"
)


def test_state_persists_between_runs(session):
    first = session.run("import math\nradius = 2")
    assert first.ok and first.results == [] and first.error is None
    second = session.run("math.pi * radius ** 2")
    assert second.status == "ok"
    assert second.text == repr(3.141592653589793 * 4)
    assert second.result_json == pytest.approx(12.566370614359172)
    assert second.execution_count == 2
    assert second.session_id == session.id


def test_output_is_streamed_to_the_callbacks_in_order_while_the_cell_runs(session):
    seen: list[tuple[str, str]] = []
    started = threading.Event()

    def on_stdout(text: str) -> None:
        seen.append(("stdout", text))
        if text == "waiting\n":
            started.set()

    outcome: list[cloche.Execution] = []
    runner = threading.Thread(
        target=lambda: outcome.append(
            session.run(
                WAIT_FOR_GO, on_stdout=on_stdout, on_stderr=lambda t: seen.append(("stderr", t))
            )
        )
    )
    runner.start()
    # The cell can only finish after this upload, which waits for its first line: so that
    # line reached the callback while the cell was still running.
    assert started.wait(30), "the first line never came"
    assert outcome == []
    session.upload("go", b"")
    runner.join(30)
    (execution,) = outcome
    # In order within a stream; across stdout and stderr (two pipes) only where the cell
    # waited between them.
    assert seen[0] == ("stdout", "waiting\n")
    assert [text for name, text in seen if name == "stdout"] == ["waiting\n", "done\n"]
    assert [text for name, text in seen if name == "stderr"] == ["released\n"]
    assert execution.logs == cloche.Logs(stdout="waiting\ndone\n", stderr="released\n")
    assert execution.text == "'finished'"


def test_a_matplotlib_figure_comes_back_as_png(session):
    displayed: list[cloche.Result] = []
    execution = session.run(PLOT + "'plotted'", on_display=displayed.append)
    assert execution.ok, execution.error
    figure, main = execution.results
    assert figure.png is not None and figure.png.startswith(PNG_MAGIC)
    assert not figure.is_main_result and "image/png" in figure.formats
    assert figure.text is not None and figure.text.startswith("<Figure")
    assert displayed == [figure]
    assert main.is_main_result and main.text == "'plotted'"
    assert execution.result == main


def test_rich_representations_are_in_the_result_bundle(session):
    execution = session.run(
        "class Table:\n"
        "    def _repr_html_(self):\n"
        "        return '<b>hi</b>'\n"
        "    def _repr_markdown_(self):\n"
        "        return '**hi**'\n"
        "    def __repr__(self):\n"
        "        return 'Table()'\n"
        "display(Table())\n"
        "Table()"
    )
    shown, main = execution.results
    assert shown.html == main.html == "<b>hi</b>"
    assert main.markdown == "**hi**" and main.text == "Table()"
    assert main.png is None


def test_an_exception_in_the_code_is_data_and_the_session_lives_on(session):
    session.run("kept = 'still here'")
    execution = session.run("print('before')\n1 / 0")
    assert execution.status == "error" and not execution.ok
    assert execution.error is not None
    assert (execution.error.ename, execution.error.evalue) == (
        "ZeroDivisionError",
        "division by zero",
    )
    assert any("1 / 0" in line for line in execution.error.traceback)
    assert execution.logs.stdout == "before\n"
    assert execution.results == []
    assert session.run("kept").text == "'still here'"


def test_a_syntax_error_is_data(session):
    execution = session.run("def broken(:\n    pass")
    assert execution.status == "error"
    assert execution.error is not None and execution.error.ename == "SyntaxError"


def test_a_cell_over_its_time_limit_is_stopped_and_reported(session):
    execution = session.run("import time\ntime.sleep(30)", timeout=1)
    assert execution.status == "timeout"
    assert execution.session_alive
    assert execution.message and "time limit" in execution.message


def test_files_go_up_and_come_down(session):
    blob = bytes(range(256)) * 10
    session.upload("data/in.bin", blob)
    session.upload("notes.txt", "héllo\n")
    execution = session.run(
        "import os\n"
        "os.makedirs('out')\n"
        "data = open('data/in.bin', 'rb').read()\n"
        "open('out/copy.bin', 'wb').write(data[::-1])\n"
        "open('notes.txt', encoding='utf-8').read()"
    )
    assert execution.ok, execution.error
    assert execution.text == repr("héllo\n")
    assert execution.files == ["out/copy.bin"]
    assert session.download("out/copy.bin") == blob[::-1]
    assert session.download("notes.txt") == "héllo\n".encode()
    listed = {f.path: f.size_bytes for f in session.list_files()}
    assert listed == {"data/in.bin": 2560, "notes.txt": 7, "out/copy.bin": 2560}


def test_missing_and_escaping_paths_are_refused(session):
    with pytest.raises(cloche.PathNotFound, match="nothing.txt"):
        session.download("nothing.txt")
    with pytest.raises(cloche.PathRefused) as refused:
        session.upload("../escape.txt", b"x")
    assert not isinstance(refused.value, cloche.PathNotFound)


def test_interrupt_stops_the_running_cell_and_the_session_survives(session):
    session.run("survivor = 42")
    started = threading.Event()
    outcome: list[cloche.Execution] = []
    runner = threading.Thread(
        target=lambda: outcome.append(
            session.run(
                "import time\nprint('sleeping', flush=True)\ntime.sleep(30)",
                on_stdout=lambda text: started.set(),
            )
        )
    )
    begun = time.monotonic()
    runner.start()
    assert started.wait(30)
    assert session.interrupt() is True
    runner.join(30)
    (execution,) = outcome
    assert execution.status == "interrupted"
    assert execution.error is not None and execution.error.ename == "KeyboardInterrupt"
    assert time.monotonic() - begun < 25  # not the 30 s the cell asked for
    assert session.interrupt() is False  # nothing runs now
    assert session.run("survivor").text == "42"


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt, as in a terminal, even when pytest was started in
    the background by a shell, which makes it inherit SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_run_interrupts_the_cell_through_the_api(session, ctrl_c_raises):
    """KeyboardInterrupt while waiting for a cell stops that cell; the session lives on."""
    session.run("survivor = 'yes'")
    main_thread = threading.main_thread().ident
    assert main_thread == threading.get_ident()

    def press_ctrl_c(text: str) -> None:  # called on the client's loop thread
        assert main_thread is not None
        signal.pthread_kill(main_thread, signal.SIGINT)

    begun = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        session.run(
            "import time\nprint('sleeping', flush=True)\ntime.sleep(30)", on_stdout=press_ctrl_c
        )
    assert time.monotonic() - begun < 25
    after = session.run("survivor")
    assert after.text == "'yes'"
    assert session.refresh().state == "idle"


def test_sessions_are_listed_and_closed_by_their_context_manager(client):
    with client.create_session(profile="lean") as session:
        assert [info.id for info in client.list_sessions()] == [session.id]
        info = client.get_session(session.id)
        assert (info.profile, info.state, info.execution_count) == ("lean", "idle", 0)
        assert info.expires_at > info.created_at
        assert info.cell_timeout_s == 20.0
    assert client.list_sessions() == []
    with pytest.raises(cloche.SessionNotFound):
        client.get_session(session.id)
    session.close()  # again: idempotent


def test_a_session_can_be_reopened_by_id(client):
    with client.create_session() as first:
        first.run("shared = [1, 2]")
        again = client.session(first.id)
        assert again.run("shared + [3]").result_json == [1, 2, 3]


def test_a_session_starts_with_its_environment_and_files(client):
    with client.create_session(env={"GREETING": "bonjour"}, files={"in.txt": "data"}) as session:
        execution = session.run("import os\n[os.environ['GREETING'], open('in.txt').read()]")
        assert execution.result_json == ["bonjour", "data"]


def test_one_shot_run_takes_files_and_returns_the_ones_it_made(
    url, token, api_server: ServerThread
):
    execution = cloche.run(
        "rows = open('in.csv').read().splitlines()\n"
        "open('out.txt', 'w').write(str(len(rows)))\n"
        "print('rows:', len(rows))\n"
        "len(rows)",
        files={"in.csv": "a,b\n1,2\n3,4\n"},
        url=url,
        token=token,
    )
    assert execution.ok
    assert execution.logs.stdout == "rows: 3\n"
    assert execution.result_json == 3
    assert execution.output_files == {"out.txt": b"3"}
    assert api_server.server.manager.list(token) == []  # its session is gone


def test_the_client_thread_ends_with_the_client(url, token):
    client = cloche.Client(url, token)
    thread = client._loop._thread
    assert thread.is_alive()
    client.close()
    assert not thread.is_alive()
    client.close()  # again: idempotent


def test_a_cell_still_waiting_when_its_session_closes_raises(client, token, api_server):
    session = client.create_session()
    started = threading.Event()
    outcomes: dict[str, object] = {}

    def run(name: str, code: str) -> None:
        try:
            outcomes[name] = session.run(code, on_stdout=lambda text: started.set())
        except cloche.ClocheError as exc:
            outcomes[name] = exc

    first = threading.Thread(
        target=run, args=("first", "import time\nprint('busy', flush=True)\ntime.sleep(30)")
    )
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=run, args=("second", "'never runs'"))
    second.start()
    deadline = time.monotonic() + 30
    while api_server.server.manager.get(session.id, token).queued_cells < 1:
        assert time.monotonic() < deadline, "the second cell never queued"
        time.sleep(0.01)
    session.close()
    first.join(30)
    second.join(30)
    assert isinstance(outcomes["first"], cloche.Execution)
    assert outcomes["first"].status in ("interrupted", "killed")
    assert isinstance(outcomes["second"], cloche.SessionNotFound), outcomes["second"]
    assert str(outcomes["second"]) == f"Session {session.id} not found"
