"""The kernel's reading of `%pip install` lines (the install itself: tests/packages)."""

from __future__ import annotations

import pytest

from cloche.kernel.pip import FUNCTION, transform


@pytest.mark.parametrize(
    ("line", "args"),
    [
        ("%pip install humanize", "install humanize"),
        ("!pip install -q humanize tabulate", "install -q humanize tabulate"),
        ("!pip3 install 'six>=1'", "install 'six>=1'"),
        ("!python -m pip install six", "install six"),
        ("% pip install six", "install six"),
        ("%pip", ""),
    ],
)
def test_pip_lines_become_calls(line, args):
    assert transform(line) == f"{FUNCTION}({args!r})"


def test_indentation_and_line_numbers_are_kept():
    source = "x = 1\nif x:\n    %pip install six\nimport six\n"
    assert transform(source).split("\n") == [
        "x = 1",
        "if x:",
        f"    {FUNCTION}('install six')",
        "import six",
        "",
    ]


@pytest.mark.parametrize(
    "source",
    ["pip = 1", "print('%pip install six')", "x = 5 %pip", "!ls", "%pipe install"],
)
def test_other_code_is_left_alone(source):
    assert transform(source) == source
