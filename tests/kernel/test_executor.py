"""Running cells in-process: REPL semantics and user-only tracebacks (see the execution spec)."""

from __future__ import annotations

import os

import pytest

import cloche.kernel.executor as executor_module
from cloche.kernel.executor import Executor, Outcome, format_error

KERNEL_DIR = os.path.dirname(os.path.abspath(executor_module.__file__))


def no_op(flag: bool) -> None:
    pass


@pytest.fixture
def executor() -> Executor:
    return Executor()


def run(executor: Executor, source: str) -> Outcome:
    return executor.run(source, no_op)


def error_of(executor: Executor, source: str) -> dict[str, object]:
    outcome = run(executor, source)
    assert outcome.exception is not None, outcome
    return format_error(outcome.exception)


# values


def test_run_does_return_the_value_of_a_last_expression(executor):
    outcome = run(executor, "x = 20\nx * 2 + 2")
    assert outcome == Outcome(has_value=True, value=42)


def test_run_does_return_no_value_for_statements_only(executor):
    outcome = run(executor, "x = 1\nif x:\n    y = 2\n")
    assert outcome == Outcome()


def test_run_does_return_no_value_when_the_last_expression_is_none(executor):
    assert run(executor, "print\nNone") == Outcome()
    assert run(executor, "def f():\n    pass\nf()") == Outcome()


def test_run_does_return_no_value_for_an_empty_cell(executor):
    assert run(executor, "") == Outcome()
    assert run(executor, "# only a comment\n") == Outcome()


def test_run_does_not_treat_an_expression_before_a_statement_as_the_value(executor):
    assert run(executor, "1 + 1\nx = 3") == Outcome()


def test_run_does_evaluate_the_last_expression_once(executor):
    run(executor, "calls = []\ndef f():\n    calls.append(1)\n    return len(calls)")
    assert run(executor, "f()").value == 1
    assert run(executor, "calls").value == [1]


def test_run_does_keep_globals_between_cells(executor):
    run(executor, "import math\nx = 40\ndef f(y):\n    return x + y")
    assert run(executor, "f(2), math.pi > 3").value == (42, True)


def test_run_does_run_user_code_as_main(executor):
    assert run(executor, "__name__").value == "__main__"


def test_run_does_put_the_last_value_in_underscore(executor):
    run(executor, "6 * 7")
    assert run(executor, "_ + 1").value == 43
    run(executor, "None")  # None leaves `_` alone, as in the interactive interpreter
    assert run(executor, "_").value == 43


def test_run_does_count_every_cell_including_failed_ones(executor):
    assert executor.execution_count == 0
    run(executor, "1")
    run(executor, "1/0")
    run(executor, "def (")
    assert executor.execution_count == 3
    assert "<cell-4>" in format_error(run(executor, "1/0").exception)["traceback"][1]


def test_run_does_call_in_cell_around_the_user_code_only(executor):
    calls: list[object] = []

    def in_cell(flag: bool) -> None:
        calls.append((flag, executor.namespace.get("ran")))

    executor.run("ran = True\n1/0", in_cell)
    assert calls == [(True, None), (False, True)]
    calls.clear()
    executor.run("def (", in_cell)  # never started: no user code ran
    assert calls == []


# exceptions


def test_run_does_capture_an_exception_as_the_outcome(executor):
    outcome = run(executor, "x = 1\nraise ValueError('bad value')")
    assert outcome.has_value is False
    assert isinstance(outcome.exception, ValueError)
    assert str(outcome.exception) == "bad value"
    assert executor.namespace["x"] == 1  # what ran before the error stays


def test_run_does_capture_an_exception_in_the_last_expression(executor):
    outcome = run(executor, "x = 1\nx / 0")
    assert isinstance(outcome.exception, ZeroDivisionError)


@pytest.mark.parametrize("raised", ["KeyboardInterrupt", "SystemExit(3)", "GeneratorExit"])
def test_run_does_capture_base_exceptions_too(executor, raised):
    outcome = run(executor, f"raise {raised}")
    assert type(outcome.exception).__name__ == raised.split("(")[0]


def test_run_does_capture_a_syntax_error(executor):
    outcome = run(executor, "x = (")
    assert isinstance(outcome.exception, SyntaxError)


def test_run_does_capture_null_bytes_in_the_source(executor):
    outcome = run(executor, "x = 1\0")
    assert isinstance(outcome.exception, SyntaxError | ValueError)


# format_error


def test_format_error_does_give_ename_evalue_and_traceback(executor):
    error = error_of(executor, "raise ValueError('bad value')")
    assert error["ename"] == "ValueError"
    assert error["evalue"] == "bad value"
    assert error["traceback"][0] == "Traceback (most recent call last):"
    assert error["traceback"][-1] == "ValueError: bad value"


def test_format_error_does_show_cell_frames_and_no_kernel_frames(executor):
    error = error_of(executor, "x = 1\ndef f():\n    return 1 / 0\nf()")
    text = "\n".join(error["traceback"])
    assert 'File "<cell-1>", line 4, in <module>' in text
    assert 'File "<cell-1>", line 3, in f' in text
    assert "return 1 / 0" in text
    assert KERNEL_DIR not in text
    assert "executor.py" not in text


def test_format_error_does_keep_library_frames_below_the_cell(executor):
    error = error_of(executor, "import json\njson.loads('{')")
    text = "\n".join(error["traceback"])
    assert "<cell-1>" in text
    assert os.path.join("json", "decoder.py") in text
    assert "executor.py" not in text


def test_format_error_does_strip_kernel_frames_from_chained_exceptions(executor):
    source = "try:\n    1/0\nexcept ZeroDivisionError as exc:\n    raise KeyError('k') from exc"
    text = "\n".join(error_of(executor, source)["traceback"])
    assert "ZeroDivisionError" in text and "KeyError" in text
    assert "direct cause" in text
    assert text.count("<cell-1>") == 2
    assert KERNEL_DIR not in text


def test_format_error_does_show_a_syntax_error_without_ast_frames(executor):
    run(executor, "1")
    error = error_of(executor, "x = 1\ny = (1,\n")
    text = "\n".join(error["traceback"])
    assert error["ename"] == "SyntaxError"
    assert 'File "<cell-2>", line' in text
    assert "ast.py" not in text
    assert "executor.py" not in text
    assert "Traceback (most recent call last)" not in text  # no frames at all


def test_format_error_does_show_the_source_lines_of_both_cells(executor):
    assert run(executor, "def divide(a):\n    return a / 0  # in cell one").exception is None
    error = error_of(executor, "n = 5\ndivide(n)  # in cell two")
    text = "\n".join(error["traceback"])
    assert 'File "<cell-2>", line 2, in <module>' in text
    assert "divide(n)  # in cell two" in text
    assert 'File "<cell-1>", line 2, in divide' in text
    assert "return a / 0  # in cell one" in text


def test_format_error_does_keep_the_traceback_when_the_exceptions_str_raises(executor):
    source = (
        "class Hostile(Exception):\n"
        "    def __str__(self):\n"
        "        raise RuntimeError('no str for you')\n"
        "    __repr__ = __str__\n"
        "raise Hostile()"
    )
    error = error_of(executor, source)
    assert error["ename"] == "Hostile"
    assert error["evalue"] == "<exception could not be formatted>"
    assert 'File "<cell-1>", line 5, in <module>' in "\n".join(error["traceback"])
    assert error["traceback"][-1].startswith("Hostile: <")


@pytest.mark.parametrize("body", ["raise SystemExit(1)", "raise KeyboardInterrupt", "return 5"])
def test_format_error_does_not_raise_whatever_the_exceptions_str_does(executor, body):
    source = f"class Hostile(Exception):\n    def __str__(self):\n        {body}\nraise Hostile()"
    error = error_of(executor, source)
    assert error["ename"] == "Hostile"
    assert error["evalue"] == "<exception could not be formatted>"
    assert 'File "<cell-1>", line 4, in <module>' in "\n".join(error["traceback"])


def test_format_error_does_not_raise_when_the_traceback_cant_be_built(executor):
    source = (
        "class Hostile(Exception):\n"
        "    @property\n"
        "    def __cause__(self):\n"
        "        raise RuntimeError('no cause for you')\n"
        "raise Hostile('message')"
    )
    error = error_of(executor, source)
    assert error == {
        "ename": "Hostile",
        "evalue": "message",
        "traceback": ["Hostile: <exception could not be formatted>"],
    }


# the kernel's own compiler flags


def test_run_does_not_leak_the_kernels_future_annotations(executor):
    run(executor, "def f(x: int) -> str:\n    return str(x)\nclass C:\n    y: float = 1.0")
    assert run(executor, "f.__annotations__").value == {"x": int, "return": str}
    assert run(executor, "C.__annotations__").value == {"y": float}


def test_run_does_evaluate_annotations_eagerly_as_plain_python_does(executor):
    outcome = run(executor, "def f(x: undefined_name):\n    pass")
    assert isinstance(outcome.exception, NameError)


def test_run_does_honour_a_future_import_in_the_cell_itself(executor):
    run(executor, "from __future__ import annotations\ndef f(x: undefined_name):\n    pass")
    assert run(executor, "f.__annotations__").value == {"x": "undefined_name"}


# sources kept for tracebacks


def test_end_cell_does_drop_the_source_of_a_cell_of_plain_statements(executor):
    import linecache

    before = len(linecache.cache)
    run(executor, "i = 0")
    for _ in range(1000):
        assert run(executor, "i += 1").exception is None
        executor.end_cell()
    assert executor.namespace["i"] == 1000
    assert len(linecache.cache) <= before + 1  # the first cell's, which was never ended


@pytest.mark.parametrize(
    "source",
    [
        "def f():\n    return 1 / 0",
        "class C:\n    def m(self):\n        return 1 / 0\nf = C().m",
        "f = lambda: 1 / 0",
        "gen = (1 / 0 for _ in [1])\nf = lambda: next(gen)",
    ],
)
def test_end_cell_does_keep_the_source_of_code_that_outlives_its_cell(executor, source):
    run(executor, source)
    executor.end_cell()
    for _ in range(3):
        run(executor, "x = 1")
        executor.end_cell()
    text = "\n".join(error_of(executor, "f()")["traceback"])
    assert 'File "<cell-1>"' in text
    assert "1 / 0" in text  # the line itself, read back from linecache


def test_end_cell_does_drop_a_failed_cells_source_after_its_traceback_was_made(executor):
    import linecache

    error = error_of(executor, "y = 1\nraise ValueError('late')")
    assert "raise ValueError('late')" in "\n".join(error["traceback"])
    executor.end_cell()
    assert "<cell-1>" not in linecache.cache
