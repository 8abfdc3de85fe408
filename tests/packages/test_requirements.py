"""What a session may ask to install: names and versions, never options, URLs or paths."""

from __future__ import annotations

import pytest

from cloche.errors import ConfigError, PackageInstallError
from cloche.packages.requirements import name_of, parse, read_allow_list


@pytest.mark.parametrize(
    "spec",
    [
        "humanize",
        "humanize==4.*",
        "Tabulate>=0.9,<1",
        "requests[socks]>=2",
        "six; python_version>'3'",
    ],
)
def test_names_versions_extras_and_markers_are_accepted(spec):
    assert parse([spec])[0].name.lower() in spec.lower()


@pytest.mark.parametrize(
    "spec",
    [
        "../../etc",
        "--index-url=https://evil.example/simple",
        "--extra-index-url",
        "-r",
        "-e.",
        "https://evil.example/x-1.0-py3-none-any.whl",
        "x @ https://evil.example/x.whl",
        "x @ file:///etc/passwd",
        "/etc/passwd",
        "./local",
        "C:\\x",
        "name with spaces",
        "",
        "x" * 300,
        "six\n--index-url=x",
    ],
)
def test_options_urls_paths_and_garbage_are_refused(spec):
    with pytest.raises(PackageInstallError):
        parse([spec])


def test_an_empty_or_huge_list_is_refused():
    with pytest.raises(PackageInstallError, match="no packages"):
        parse([])
    with pytest.raises(PackageInstallError, match="at most"):
        parse(["six"] * 100)


def test_names_are_normalised():
    assert name_of(parse(["Foo.Bar_baz"])[0]) == "foo-bar-baz"


def test_allow_list_file(tmp_path):
    path = tmp_path / "allow.txt"
    path.write_text("# allowed\nHumanize\n\nsix  # comment\n")
    assert read_allow_list(path) == {"humanize", "six"}
    path.write_text("six>=1\n")
    with pytest.raises(ConfigError, match="line 1"):
        read_allow_list(path)
    with pytest.raises(ConfigError):
        read_allow_list(tmp_path / "missing.txt")
