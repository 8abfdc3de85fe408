"""The commands of the `cloche` CLI: serve (the server), and its clients: run, repl, exec,
shell, rlm, sessions, snapshots, templates, ports, volumes, nodes, tool-schema, mcp, bench.

Each module has an `add(subparsers)` that registers its command(s); `cloche.cli` calls
`add_commands`.
"""

from __future__ import annotations

from typing import Any

from cloche.commands import (
    agents,
    bench,
    execute,
    nodes,
    ports,
    repl,
    rlm,
    run,
    serve,
    sessions,
    shell,
    snapshots,
    templates,
    volumes,
)


def add_commands(subparsers: Any) -> None:
    """Register the commands on the `cloche` parser's subparsers."""
    for module in (
        serve,
        run,
        repl,
        execute,
        shell,
        rlm,
        sessions,
        snapshots,
        templates,
        ports,
        volumes,
        nodes,
        agents,
        bench,
    ):
        module.add(subparsers)
