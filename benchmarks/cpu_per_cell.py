"""Where each cell's CPU goes, by component, as the number of busy sessions grows.

    sudo .venv/bin/python benchmarks/suite.py --cpu-per-cell [--levels 1,10,50,100]
        [--platforms systrap,ptrace] [--seconds 10]

For each platform, one `cloche serve --platform P`; at each level, that many TCP clients
(in this process's event loop) each loop `i += 1` in a session of its own for `--seconds`.
The CPU used meanwhile is read from /proc (utime + stime of every thread) and divided by
the cells run, per component: the server, the sandboxes' runsc processes by name
(runsc-sandbox: the sentry; the systrap stubs and ptrace tracees that run the app carry
other names), the clients (this process), and the whole machine (which on a shared machine
includes other people's work: compare levels inside one run only).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time
from collections import Counter
from pathlib import Path
from typing import Any

from cloche.bench import HTTPSessions, Target, TCPCell, Worker, http_client, measure

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> tuple[str, float]:
    """(kind, CPU seconds so far) of a process, every thread counted. The kind is argv[0]
    (runsc re-executes itself, so every runsc process's comm is "exe"): runsc-sandbox is
    the sentry, runsc-gofer the file proxy, runsc the attached `runsc run`; a process with
    no command line is one the sentry made to run the app (a systrap stub, a ptrace
    tracee)."""
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        argv0 = cmdline.read().split(b"\0")[0].decode(errors="replace")
    with open(f"/proc/{pid}/stat") as stat:
        text = stat.read()
    fields = text.rsplit(")", 1)[1].split()
    return Path(argv0).name or "app", (int(fields[11]) + int(fields[12])) * TICK_S


def with_children(pids: list[int]) -> list[int]:
    """pids and all their descendants (the sentries' app processes have no command line to
    find them by, and under ptrace they are the sentry's grandchildren: its first stub
    forks the others)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                parent = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return sorted(found)


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (not idle, not iowait)."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    idle = values[3] + values[4]
    return (sum(values[:8]) - idle) * TICK_S


def snapshot(server_pid: int, sandbox_pids: list[int]) -> dict[str, float]:
    """CPU seconds by component: server, each sandbox process name, clients, machine."""
    used: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        used["server"] = process_cpu_s(server_pid)[1]
    for pid in sandbox_pids:
        with contextlib.suppress(OSError):
            name, seconds = process_cpu_s(pid)
            used[f"sandbox:{name}"] += seconds
    own = resource.getrusage(resource.RUSAGE_SELF)
    used["clients"] = own.ru_utime + own.ru_stime
    used["machine"] = machine_cpu_s()
    return dict(used)


async def level_cpu(
    target: Target,
    server_pid: int,
    sandbox_pids: Any,
    level: int,
    seconds: float,
) -> dict[str, Any]:
    """Run `level` busy sessions for about `seconds`; cells/s, latency, CPU per cell."""
    async with http_client(target, level) as http:
        sessions = HTTPSessions(target, http)
        workers: list[Worker] = [TCPCell(target, sessions) for _ in range(level)]
        gate = asyncio.Semaphore(2 * (os.cpu_count() or 1))

        async def open_one(worker: Worker) -> None:
            async with gate:
                await worker.open()

        await asyncio.gather(*(open_one(w) for w in workers))
        try:
            for worker in workers:  # warm: each session has run cells
                for _ in range(3):
                    await worker.once()
            probe = await measure("probe", _lend(workers), total=level * 20, concurrency=level)
            total = max(level * 20, int(probe.throughput * seconds))
            pids = sandbox_pids()
            before = snapshot(server_pid, pids)
            report = await measure("cells", _lend(workers), total=total, concurrency=level)
            after = snapshot(server_pid, pids)
        finally:
            await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
    cells = len(report.samples_s)
    per_cell_us = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / cells * 1e6 for k in after}
    sandboxes = sum(v for k, v in per_cell_us.items() if k.startswith("sandbox:"))
    return {
        "sessions": level,
        "cells": cells,
        "errors": report.errors,
        "cells_per_s": report.throughput,
        "p50_ms": report.percentile_ms(50),
        "p99_ms": report.percentile_ms(99),
        "cpu_per_cell_us": per_cell_us,
        "cloche_cpu_per_cell_us": per_cell_us.get("server", 0.0) + sandboxes,
        "load_average_1min": os.getloadavg()[0],
    }


def _lend(workers: list[Worker]) -> Any:
    queue = iter(workers)

    class Lease(Worker):
        def __init__(self) -> None:
            self.worker = next(queue)

        async def once(self) -> float:
            return await self.worker.once()

    return Lease


def run_platform(
    serve: Any, base: Path, platform: str, levels: list[int], seconds: float
) -> list[dict[str, Any]]:
    """Every level against one `cloche serve --platform platform`. A platform may carry
    more of serve's options after colons: `auto:--cell-slots=1000` (its rows are labelled
    with the whole string)."""
    rows = []
    label = platform
    platform, *extra = platform.split(":")
    state = base / f"cpu-{len(rows)}-{abs(hash(label))}"
    with serve(
        state,
        *extra,
        "--platform", platform,
        "--pool-size", "2",
        "--data-pool-size", "0",
        "--max-sessions", str(max(levels) + 20),
    ) as server:  # fmt: skip
        server.wait_pooled("lean", 2)

        def sandbox_pids() -> list[int]:
            return with_children(server.sandbox_pids())

        for level in levels:
            began = time.monotonic()
            row = asyncio.run(
                level_cpu(server.target, server.process.pid, sandbox_pids, level, seconds)
            )
            row["platform"] = label
            row["took_s"] = time.monotonic() - began
            rows.append(row)
            yield_row(row)
    return rows


def yield_row(row: dict[str, Any]) -> None:
    parts = ", ".join(
        f"{k.removeprefix('sandbox:')} {v:,.0f}"
        for k, v in sorted(row["cpu_per_cell_us"].items(), key=lambda kv: -kv[1])
        if v >= 1
    )
    print(
        f"[cpu] {row['platform']} x{row['sessions']}: {row['cells_per_s']:,.0f} cells/s, "
        f"p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.1f} ms, errors {row['errors']}; "
        f"µs per cell: {parts} (load {row['load_average_1min']:.1f})",
        flush=True,
    )


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the rows: throughput, latency and CPU per cell by component."""
    names = sorted(
        {k for row in rows for k, v in row["cpu_per_cell_us"].items() if v >= 1 and k != "machine"}
    )
    header = ["platform", "busy sessions", "cells/s", "p50 ms", "p99 ms", "errors"]
    header += [f"{name.removeprefix('sandbox:')} µs" for name in names]
    header += ["server+sandboxes µs", "machine µs", "load avg"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cpu = row["cpu_per_cell_us"]
        cells = [
            row["platform"],
            str(row["sessions"]),
            f"{row['cells_per_s']:,.0f}",
            f"{row['p50_ms']:.2f}",
            f"{row['p99_ms']:.1f}",
            str(row["errors"]),
            *(f"{cpu.get(name, 0.0):,.0f}" for name in names),
            f"{row['cloche_cpu_per_cell_us']:,.0f}",
            f"{cpu.get('machine', 0.0):,.0f}",
            f"{row['load_average_1min']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
