"""The commands of the `cloche` CLI: serve (the server), and its clients: run, repl, rlm,
sessions, snapshots, templates, volumes, nodes, tool-schema, mcp, bench.

Each module has an `add(subparsers)` that registers its command(s); `cloche.cli` calls
`add_commands`.
"""

from __future__ import annotations

from typing import Any

from cloche.commands import (
    agents,
    bench,
    nodes,
    repl,
    rlm,
    run,
    serve,
    sessions,
    snapshots,
    templates,
    volumes,
)


def add_commands(subparsers: Any) -> None:
    """Register the commands on the `cloche` parser's subparsers."""
    commands = (serve, run, repl, rlm, sessions, snapshots, templates, volumes, nodes, agents)
    for module in (*commands, bench):
        module.add(subparsers)
