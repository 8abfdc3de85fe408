"""The observer the layers below the front ends report to, and the metrics that implement it."""

import ast
import inspect
from pathlib import Path

import cloche
from cloche.server.metrics import Metrics
from cloche.sessions.observer import Observer

_PACKAGE = Path(cloche.__file__).parent
_BELOW_THE_FRONT_ENDS = ("sessions", "sandbox", "llm", "packages", "protocol", "kernel")


def _events() -> list[str]:
    return [name for name, _ in inspect.getmembers(Observer, inspect.isfunction)]


def test_metrics_count_every_event_the_observer_is_told():
    missing = [name for name in _events() if name not in vars(Metrics)]
    assert missing == []


def test_the_default_observer_ignores_every_event():
    observer = Observer()
    for name in _events():
        arity = len(inspect.signature(getattr(Observer, name)).parameters) - 1
        assert getattr(observer, name)(*([None] * arity)) is None


def test_layers_below_the_front_ends_import_nothing_of_the_server():
    offenders = []
    for folder in _BELOW_THE_FRONT_ENDS:
        for path in sorted((_PACKAGE / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                offenders += [
                    f"{path.relative_to(_PACKAGE)}: {name}"
                    for name in names
                    if name == "cloche.server" or name.startswith("cloche.server.")
                ]
    assert offenders == []
