"""IPython cell syntax in the kernel: its translation to Python, and cells run through the
Executor (no sandbox; the same code runs in one in tests/server/test_ipython_cells.py)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cloche.kernel.executor import Executor, format_error
from cloche.kernel.expansion import expand
from cloche.kernel.ipython import SHELL, translate
from cloche.kernel.pip import FUNCTION as PIP
from cloche.kernel.shell import SList
from cloche.kernel.timing import format_time
from support import TIME, timeit_printed

# -- translation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "python"),
    [
        ("!ls -la", f"{SHELL}.system('ls -la')"),
        ("!!ls", f"{SHELL}.getoutput('ls')"),
        ("files = !ls *.py", f"files = {SHELL}.getoutput('ls *.py')"),
        ("a, b = !echo 1; echo 2", f"a, b = {SHELL}.getoutput('echo 1; echo 2')"),
        ("self.x = !pwd", f"self.x = {SHELL}.getoutput('pwd')"),
        ("%cd /tmp", f"{SHELL}.run_line('cd', '/tmp')"),
        ("%pwd", f"{SHELL}.run_line('pwd', '')"),
        ("t = %timeit -o f()", f"t = {SHELL}.run_line('timeit', '-o f()')"),
        ("%unknown x", f"{SHELL}.run_line('unknown', 'x')"),
        ("%%bash", f"{SHELL}.run_line('%bash', '')"),  # not on a cell's first line
        ("len?", f"{SHELL}.run_line('pinfo', 'len')"),
        ("os.path.join??", f"{SHELL}.run_line('pinfo2', 'os.path.join')"),
        ("?len", f"{SHELL}.run_line('pinfo', 'len')"),
        ("%time?", f"{SHELL}.run_line('pinfo', '%time')"),
        ("%%bash?", f"{SHELL}.run_line('pinfo', '%%bash')"),
        ("%pip install six", f"{PIP}('install six')"),
        ("!pip install -q six", f"{PIP}('install -q six')"),
        ("x = %pip install six", f"x = {PIP}('install six')"),
    ],
)
def test_a_line_of_ipython_becomes_one_call(line, python):
    assert translate(f"x = 1\n{line}\n") == f"x = 1\n{python}\n"


def test_lines_inside_blocks_keep_their_indentation():
    source = "for i in range(2):\n    !echo {i}\n    if i:\n\tx = %pwd\n"
    assert translate(source).split("\n") == [
        "for i in range(2):",
        f"    {SHELL}.system('echo {{i}}')",
        "    if i:",
        f"\tx = {SHELL}.run_line('pwd', '')",
        "",
    ]


def test_a_cell_magic_is_one_call_on_its_line_and_keeps_the_line_count():
    source = "\n%%bash -x\necho 'a'\n  echo b\n"
    translated = translate(source)
    assert translated.split("\n") == [
        "",
        f"{SHELL}.run_cell('bash', '-x', \"echo 'a'\\n  echo b\\n\")",
        "",
        "",
        "",
    ]


def test_a_cell_magic_body_ends_with_a_newline_as_ipython_passes_it():
    expected = f"{SHELL}.run_cell('writefile', 'f.txt', 'abc\\n')\n"
    assert translate("%%writefile f.txt\nabc") == expected


def test_backslash_continuations_of_a_command_are_joined_and_the_lines_kept():
    source = "!echo a \\\n  b \\\n  c\nx = 1"
    assert translate(source).split("\n") == [f"{SHELL}.system('echo a b c')", "", "", "x = 1"]


@pytest.mark.parametrize(
    "source",
    [
        "a != b",
        "x = 7 % 3",
        "'%d%%' % 5",
        "d = {'!': 1, '%': 2}",
        "s = {1, 2}",
        "f'{x!r} {y!s:>5} !ls %cd'",
        "x = 1  # why?",
        "print('!ls')\nprint('%pwd')",
        "not_ = not x",
    ],
)
def test_python_is_left_alone(source):
    assert translate(source) is source


def test_strings_and_brackets_are_not_read_as_commands():
    source = (
        "s = '''\n!not a command\n%not a magic\n'''\n"
        "n = (1\n  % 2)\n"
        "t = 'it\\'s' + \\\n  'x'\n"
        "!echo yes"
    )
    translated = translate(source).split("\n")
    assert translated[:-1] == source.split("\n")[:-1]
    assert translated[-1] == f"{SHELL}.system('echo yes')"


def test_a_syntax_error_elsewhere_is_reported_on_the_line_as_written():
    executor = Executor()
    outcome = executor.run("!echo hi\nx = (\n", _nothing)
    assert isinstance(outcome.exception, SyntaxError)
    assert outcome.exception.lineno == 2


# -- expansion of commands ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "expanded"),
    [
        ("echo $name", "echo world"),
        ("echo {name.upper()} {n + 1}", "echo WORLD 3"),
        ("echo $n.real", "echo 2"),
        ("echo $name.txt", "echo world.txt"),  # no attribute `txt`: the name alone
        ("echo $$name $$HOME", "echo $name $HOME"),
        ("echo $HOME $((1 + 2)) ${HOME} $1 $$", "echo $HOME $((1 + 2)) ${HOME} $1 $$"),
        ("echo '$name' \"$name\"", "echo '$name' \"world\""),
        ("find . -exec echo {} \\;", "find . -exec echo {} \\;"),
        ("awk '{print $1}'", "awk '{print $1}'"),
        ("echo {{literal}} {nope}", "echo {literal} {nope}"),
        ("echo {name!r}", "echo 'world'"),
        ("echo } {", "echo } {"),
    ],
)
def test_python_values_are_expanded_in_commands_as_ipython_does(command, expanded):
    assert expand(command, {"name": "world", "n": 2}) == expanded


# -- running cells -----------------------------------------------------------------------


def _nothing(flag: bool) -> None:
    pass


@pytest.fixture
def executor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Executor]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLOCHE_TEST_VAR", raising=False)
    yield Executor()


def run(executor: Executor, code: str) -> Any:
    """The cell's value; its exception is raised here."""
    outcome = executor.run(code, _nothing)
    executor.end_cell()
    if outcome.exception is not None:
        raise outcome.exception
    return outcome.value


def error_of(executor: Executor, code: str) -> dict[str, Any]:
    outcome = executor.run(code, _nothing)
    executor.end_cell()
    assert outcome.exception is not None
    return format_error(outcome.exception)


def test_a_command_writes_to_stdout_and_stderr_and_sets_the_exit_code(executor, capsys):
    assert run(executor, "!echo hi; echo oops >&2; exit 3") is None
    out, err = capsys.readouterr()
    assert (out, err) == ("hi\n", "oops\n")
    assert executor.namespace["_exit_code"] == 3


def test_a_command_runs_in_the_working_directory(executor, tmp_path, capsys):
    run(executor, "!pwd")
    assert capsys.readouterr().out == f"{tmp_path}\n"


def test_assigning_a_command_gives_its_lines(executor):
    run(executor, "files = !printf 'a.py\\nB.txt\\nc.py\\n'; echo err >&2")
    files = executor.namespace["files"]
    assert isinstance(files, SList) and isinstance(files, list)
    assert files == ["a.py", "B.txt", "c.py", "err"]
    assert files.n == "a.py\nB.txt\nc.py\nerr"
    assert files.s == "a.py B.txt c.py err"
    assert files.l is files and files.list is files
    assert files.grep(r"\.py$") == ["a.py", "c.py"]
    assert files.grep("b") == ["B.txt"]  # case-insensitive, as IPython
    assert files.grep("py", prune=True) == ["B.txt", "err"]


def test_commands_see_python_values_and_locals(executor, capsys):
    code = "name = 'world'\ndef greet(n):\n    !name=sh; echo $name {n * 2} $$name\ngreet(21)"
    run(executor, code)
    assert capsys.readouterr().out == "world 42 sh\n"


def test_get_ipython_runs_commands_and_magics(executor, capsys):
    assert run(executor, "get_ipython().getoutput('echo a; echo b')") == ["a", "b"]
    assert run(executor, "get_ipython().getoutput('echo a', split=False)") == "a\n"
    run(executor, "get_ipython().system('echo sys')")
    assert capsys.readouterr().out == "sys\n"
    assert run(executor, "get_ipython().run_line_magic('pwd', '')") == os.getcwd()
    run(executor, "get_ipython().run_cell_magic('bash', '', 'echo $((6 * 7))')")
    assert capsys.readouterr().out == "42\n"
    assert run(executor, "get_ipython().user_ns is globals()") is True


def test_bash_and_sh_cells_run_their_body(executor, capsys):
    run(executor, "%%bash\nfor i in 1 2; do echo $i; done\necho $((1 + 1))")
    assert capsys.readouterr().out == "1\n2\n2\n"
    run(executor, "%%sh\necho sh: $0")
    assert capsys.readouterr().out == "sh: /bin/sh\n"


def test_a_failing_bash_cell_raises_as_ipython_does(executor, capsys):
    error = error_of(executor, "%%bash\necho partial\nexit 4")
    assert error["ename"] == "CalledProcessError"
    assert "returned non-zero exit status 4" in error["evalue"]
    assert capsys.readouterr().out == "partial\n"
    run(executor, "%%bash --no-raise-error\nexit 4")


def test_an_interrupt_kills_the_command_and_its_children(executor, tmp_path):
    fifo = tmp_path / "pid"
    os.mkfifo(fifo)
    main = threading.get_ident()
    pids: list[int] = []

    def interrupt_once_started() -> None:
        with open(fifo) as reader:  # the command writes its pid once it runs
            pids.extend(int(word) for word in reader.read().split())
        signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    helper = threading.Thread(target=interrupt_once_started)
    helper.start()
    try:
        code = f"!sleep 60 & echo $$ $! > {fifo}; wait"
        outcome = executor.run(code, _nothing)
    finally:
        helper.join()
        signal.signal(signal.SIGINT, previous)
    assert isinstance(outcome.exception, KeyboardInterrupt)
    shell_pid, sleep_pid = pids
    with pytest.raises(ProcessLookupError):
        os.kill(shell_pid, 0)  # reaped
    deadline = time.monotonic() + 30  # SIGKILL is delivered, not waited for, by the kernel
    while not _dead(sleep_pid):
        assert time.monotonic() < deadline, f"the command's child {sleep_pid} lives on"
        time.sleep(0.01)
    assert run(executor, "1 + 1") == 2


def _dead(pid: int) -> bool:
    """Gone, or a zombie (its parent was killed: whoever adopted it reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(") ")[2].startswith("Z")
    except FileNotFoundError:
        return True


def test_a_command_that_leaves_a_job_behind_does_not_hold_the_cell(executor, capsys):
    run(executor, "!sleep 60 & echo started $!")
    started, pid = capsys.readouterr().out.split()
    os.kill(int(pid), signal.SIGKILL)
    assert started == "started"


# -- magics ------------------------------------------------------------------------------


def test_cd_and_pwd(executor, tmp_path, capsys):
    (tmp_path / "sub dir").mkdir()
    run(executor, "%cd 'sub dir'")
    assert capsys.readouterr().out == f"{tmp_path / 'sub dir'}\n"
    assert run(executor, "%pwd") == str(tmp_path / "sub dir")
    run(executor, "%cd -q -")
    assert os.getcwd() == str(tmp_path)
    assert capsys.readouterr().out == ""
    with pytest.raises(FileNotFoundError):
        run(executor, "%cd nowhere")


def test_env_sets_gets_and_lists(executor, capsys):
    run(executor, "%env CLOCHE_TEST_VAR=a b")
    assert capsys.readouterr().out == "env: CLOCHE_TEST_VAR=a b\n"
    assert os.environ["CLOCHE_TEST_VAR"] == "a b"
    assert run(executor, "%env CLOCHE_TEST_VAR") == "a b"
    run(executor, "%env CLOCHE_TEST_VAR other")
    assert run(executor, "%env")["CLOCHE_TEST_VAR"] == "other"
    run(executor, "!echo $CLOCHE_TEST_VAR")
    assert capsys.readouterr().out.endswith("other\n")
    error = error_of(executor, "%env CLOCHE_NO_SUCH_VAR")
    assert error["ename"] == "UsageError"
    assert error["evalue"] == "Environment does not have key: CLOCHE_NO_SUCH_VAR"


def test_env_hides_secrets_when_listing(executor, monkeypatch):
    monkeypatch.setenv("CLOCHE_TEST_TOKEN", "s3cret")
    assert run(executor, "%env")["CLOCHE_TEST_TOKEN"] == "<hidden>"
    assert run(executor, "%env CLOCHE_TEST_TOKEN") == "s3cret"


def test_time_prints_cpu_and_wall_time_and_gives_the_value(executor, capsys):
    assert run(executor, "%time sum(range(10))") == 45
    out = capsys.readouterr().out
    assert re.fullmatch(
        rf"CPU times: user {TIME}, sys: {TIME}, total: {TIME}\nWall time: {TIME}\n", out
    ), out
    assert run(executor, "%%time\nx = 2\nx * 21") == 42
    assert "Wall time" in capsys.readouterr().out


def test_timeit_warns_when_the_slowest_run_took_over_four_times_the_fastest(executor, capsys):
    run(executor, "import time\nslept = []")
    run(executor, "%timeit -n 1 -r 5 slept or slept.append(time.sleep(0.2))")  # the first run
    out = capsys.readouterr().out
    warning, summary = out.splitlines()
    assert re.fullmatch(
        r"The slowest run took \d+\.\d\d times longer than the fastest\. "
        r"This could mean that an intermediate result is being cached\.",
        warning,
    ), out
    assert re.fullmatch(timeit_printed("5 runs", "1 loop"), f"{summary}\n"), out


def test_timeit_prints_ipythons_summary(executor, capsys):
    run(executor, "%timeit -n 3 -r 2 sum(range(10))")
    out = capsys.readouterr().out
    assert re.fullmatch(timeit_printed("2 runs", "3 loops"), out), out
    run(executor, "%%timeit -n 1000 -r 1 data = list(range(100))\nsorted(data)")
    out = capsys.readouterr().out
    assert re.fullmatch(timeit_printed("1 run", "1,000 loops"), out), out
    result = run(executor, "%timeit -q -o -n 2 -r 3 !true")
    assert capsys.readouterr().out == ""
    assert (result.loops, result.repeat, len(result.all_runs)) == (2, 3, 3)
    assert repr(result).startswith("<TimeitResult : ")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (1.234e-3, "1.23 ms"),
        (4.561e-6, "4.56 μs"),
        (2.1, "2.1 s"),
        (5e-10, "0.5 ns"),
        (0.0123, "12.3 ms"),
        (75.5, "1min 15s"),
        (0.0, "0 ns"),
    ],
)
def test_times_are_written_in_ipythons_units(seconds, text):
    assert format_time(seconds) == text


def test_writefile_writes_overwrites_and_appends(executor, tmp_path, capsys):
    run(executor, "%%writefile notes.txt\nline 1\nline 2")
    assert capsys.readouterr().out == "Writing notes.txt\n"
    run(executor, "%%writefile notes.txt\nfresh")
    assert capsys.readouterr().out == "Overwriting notes.txt\n"
    run(executor, "%%writefile -a notes.txt\nmore")
    assert capsys.readouterr().out == "Appending to notes.txt\n"
    assert (tmp_path / "notes.txt").read_text() == "fresh\nmore\n"
    run(executor, "name = 'other.txt'\n")
    run(executor, "%%writefile {name}\nx")
    assert (tmp_path / "other.txt").read_text() == "x\n"


def test_who_and_whos_list_the_users_variables(executor, capsys):
    run(executor, "import json\nnumber = 1\ntext = 'hi'\nitems = [1, 2]\n_hidden = 3")
    run(executor, "%who")
    assert capsys.readouterr().out == "items\t json\t number\t text\t \n"
    run(executor, "%who int str")
    assert capsys.readouterr().out == "number\t text\t \n"
    run(executor, "%whos")
    table = capsys.readouterr().out.splitlines()
    assert table[:3] == [
        "Variable   Type      Data/Info",
        "------------------------------",
        "items      list      n=2",
    ]
    assert table[3].startswith("json       module    <module 'json' from ")
    assert "<...>" in table[3]  # cut to 25 + 25 characters, as IPython
    assert table[4:] == ["number     int       1", "text       str       hi"]


def test_reset_clears_the_namespace_but_not_the_shell(executor, capsys):
    run(executor, "x = 1\nimport os")
    run(executor, "%reset -f")
    run(executor, "%who")
    assert capsys.readouterr().out == "Interactive namespace is empty.\n"
    assert run(executor, "get_ipython().getoutput('echo ok')") == ["ok"]
    assert error_of(executor, "%reset")["ename"] == "UsageError"


def test_history_lists_the_sessions_cells(executor, capsys):
    run(executor, "x = 1")
    run(executor, "for i in range(2):\n    x += i")
    run(executor, "%history -n")
    assert capsys.readouterr().out == (
        "   1: x = 1\n   2:\nfor i in range(2):\n    x += i\n   3: %history -n\n"
    )
    run(executor, "%history 1")
    assert capsys.readouterr().out == "x = 1\n"


def test_run_runs_a_script_as_main_and_keeps_its_names(executor, tmp_path, capsys):
    (tmp_path / "script.py").write_text(
        "import sys\nresult = sys.argv[1:]\nif __name__ == '__main__':\n    print('main')\n"
    )
    run(executor, "%run script.py a 'b c'")
    assert capsys.readouterr().out == "main\n"
    assert executor.namespace["result"] == ["a", "b c"]
    assert "__file__" not in executor.namespace
    (tmp_path / "fails.py").write_text("x = 1\n\nraise ValueError('in the script')\n")
    error = error_of(executor, "%run fails.py")
    assert error["ename"] == "ValueError"
    assert f'File "{tmp_path / "fails.py"}", line 3, in <module>' in "\n".join(error["traceback"])
    assert error_of(executor, "%run missing.py")["ename"] == "UsageError"


def test_load_runs_the_files_code_in_the_session(executor, tmp_path):
    (tmp_path / "snippet.py").write_text("loaded = 40\nloaded + 2\n")
    assert run(executor, "%load snippet.py") == 42
    assert executor.namespace["loaded"] == 40


def test_matplotlib_inline_is_accepted(executor):
    assert run(executor, "%matplotlib inline") is None
    assert error_of(executor, "%matplotlib qt")["ename"] == "UsageError"


# -- help and errors ---------------------------------------------------------------------


def test_help_prints_signature_and_docstring(executor, capsys):
    run(executor, "def area(w, h=1):\n    'The area.'\n    return w * h")
    run(executor, "area?")
    assert capsys.readouterr().out == (
        "Signature: area(w, h=1)\nDocstring: The area.\nFile:      <cell-1>\nType:      function\n"
    )
    run(executor, "area??")
    out = capsys.readouterr().out
    assert "Source:   \ndef area(w, h=1):\n    'The area.'\n    return w * h\n" in out
    run(executor, "?len")
    assert capsys.readouterr().out.startswith("Signature: len(obj, /)\nDocstring: Return")
    run(executor, "nothing_here?")
    assert capsys.readouterr().out == "Object `nothing_here` not found.\n"
    text = executor.shell.help_text("area")
    assert text.startswith("Signature: area(w, h=1)\n")


def test_an_unknown_magic_is_a_usage_error_naming_what_there_is(executor):
    error = error_of(executor, "x = 1\n%autoreload 2")
    assert error["ename"] == "UsageError"
    assert error["evalue"].startswith("Line magic function `%autoreload` not found.")
    assert "%timeit" in error["evalue"] and "%%bash" in error["evalue"]
    assert error["traceback"][-1].startswith("UsageError: Line magic function")
    assert '  File "<cell-1>", line 2, in <module>' in error["traceback"]
    assert "    %autoreload 2" in error["traceback"]
    cell = error_of(executor, "%%capture\nprint(1)")
    assert cell["evalue"].startswith("Cell magic `%%capture` not found.")
    hint = error_of(executor, "%writefile x")["evalue"]
    assert "But cell magic `%%writefile` exists" in hint


def test_tracebacks_point_at_the_users_lines(executor):
    error = error_of(executor, "!true\nx = %pwd\n!true\nx + 1")
    assert error["traceback"][-4:] == [
        '  File "<cell-1>", line 4, in <module>',
        "    x + 1",
        "    ~~^~~",
        'TypeError: can only concatenate str (not "int") to str',
    ]
    error = error_of(executor, "%%time\nx = 1\n\ny = 1 / 0\n")
    assert '  File "<cell-2>", line 4, in <module>' in error["traceback"]
    assert "    y = 1 / 0" in error["traceback"]
    error = error_of(executor, "a = 1\n%time b = a / 0")
    lines = error["traceback"]
    assert lines[-4:] == [
        '  File "<cell-3>", line 2, in <module>',
        "    %time b = a / 0",
        "              ~~^~~",  # the column in the line as written
        "ZeroDivisionError: division by zero",
    ]
