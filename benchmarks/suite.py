"""cloche against its floor and its alternatives, side by side, in one run on one machine.

    .venv/bin/python benchmarks/suite.py [--quick] [--out benchmarks/results]

Needs root and runsc (./test.sh installs both). In one run it measures:

- the floor: a frame echoed through a runsc sandbox's pipes (cloche's own sandbox set-up,
  an echo loop instead of the kernel), and a cold `runsc run` of `python3 -S -c pass`;
- unsandboxed Jupyter: ipykernel driven by jupyter_client (`execute_interactive`);
- one sandbox per cell: a `runsc run` of `python3 -c 'print(1+1)'` per execution;
- cloche (`cloche serve` in its own process, as users run it): warm cells over TCP and
  HTTP, new sessions from the pool (lean and data) and without one, `import pandas` in a
  data session, Terrarium-style one-shot requests, cells/s and p99 at 1-200 concurrent
  sessions (against the floor's echo with as many sandboxes), memory per idle session
  (PSS of the sandboxes' processes, and the drop of MemAvailable), and whether 500 idle
  sessions leave the server answering.

Single-client latencies are taken in alternating blocks (floor, TCP, HTTP, Jupyter), so
every one of them sees the same machine. Results go to OUT/results.json, OUT/results.md
and PNG plots in OUT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cleanup import foreign_runsc, leftovers, scratch_dir
from floor import Floor
from serving import serving
from suite_latency import (
    Jupyter,
    new_sessions,
    new_sessions_missing,
    per_cell_sandbox,
    single_client_latencies,
)
from suite_memory import idle_sessions_fit, memory_per_session, outside_memory
from suite_run import DATA_POOL, POOL, Run, log
from suite_throughput import throughput_levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cells", type=int, default=2000, help="single-client round trips")
    parser.add_argument("--sessions", type=int, default=12, help="new-session samples")
    parser.add_argument("--levels", default="1,10,50", help="concurrent sessions")
    parser.add_argument("--ops", type=int, default=3000, help="cells per throughput level")
    parser.add_argument(
        "--floor-max",
        type=int,
        default=None,
        help="measure the floor only at levels up to this (its echo sandboxes are never "
        "frozen: ~80 idle ones saturate 2 cores); default: at every level",
    )
    parser.add_argument("--idle", type=int, default=60, help="idle sessions to hold (0: skip)")
    parser.add_argument(
        "--freeze-idle",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start the main server with --freeze-idle (default: cloche serve's, 30 s)",
    )
    parser.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    parser.add_argument(
        "--cpu-per-cell",
        action="store_true",
        help="only measure CPU per cell by component at --levels busy sessions on each of "
        "--platforms (see benchmarks/cpu_per_cell.py)",
    )
    parser.add_argument("--platforms", default="systrap,ptrace", help="for --cpu-per-cell")
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="for --cpu-per-cell: time per level"
    )
    args = parser.parse_args(argv)
    if args.cpu_per_cell:
        return cpu_per_cell_mode(args)
    if args.quick:
        args.cells, args.sessions, args.levels, args.ops, args.idle = 300, 4, "1,5", 200, 10
    levels = [int(x) for x in args.levels.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run()
    run.facts = machine_facts()
    log(f"machine: {run.facts}")

    def save() -> None:
        """Write what is measured so far (a run cut short keeps its figures)."""
        (args.out / "results.json").write_text(json.dumps(run.__dict__, indent=1))

    run.facts["args"] = vars(args) | {"out": str(args.out)}
    with scratch_dir() as base:
        try:
            measure_all(run, base, args, levels, save)
        finally:
            left = leftovers(base)
            if left:
                log("LEFT BEHIND: " + "; ".join(left))
    run.facts["foreign_runsc_after"] = len(foreign_runsc(Path("/nonexistent")))
    (args.out / "results.json").write_text(json.dumps(run.__dict__, indent=1))
    from report import write_report

    write_report(run.__dict__, args.out)
    log(f"results in {args.out}")
    return 0


def cpu_per_cell_mode(args: argparse.Namespace) -> int:
    """The --cpu-per-cell mode: its table on stdout, its rows in OUT/cpu_per_cell.json."""
    from cpu_per_cell import run_platform, table

    levels = [int(x) for x in args.levels.split(",")]
    rows: list[dict[str, Any]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    with scratch_dir() as base:
        try:
            for platform_name in args.platforms.split(","):
                rows += run_platform(serving, base, platform_name, levels, args.seconds)
                (args.out / "cpu_per_cell.json").write_text(json.dumps(rows, indent=1))
        finally:
            left = leftovers(base)
            if left:
                log("LEFT BEHIND: " + "; ".join(left))
    print(table(rows))
    return 0


def measure_all(
    run: Run, base: Path, args: argparse.Namespace, levels: list[int], save: Callable[[], None]
) -> None:
    with Floor(base / "floor") as floor:
        log("cold runsc starts and one sandbox per cell")
        run.samples_ms["cold_runsc"] = [floor.cold_run() for _ in range(max(3, args.sessions // 2))]
        run.samples_ms["sandbox_per_cell"] = per_cell_sandbox(floor, max(3, args.sessions // 2))
        max_sessions = max(levels) + args.idle + 50
        with serving(
            base / "server",
            "--pool-size", str(POOL),
            "--data-pool-size", str(DATA_POOL),
            "--max-sessions", str(max_sessions),
            *(() if args.freeze_idle is None else ("--freeze-idle", str(args.freeze_idle))),
        ) as server, Jupyter() as jupyter:  # fmt: skip
            server.wait_pooled("lean", POOL)
            server.wait_pooled("data", DATA_POOL)
            log("single-client latency: floor, TCP, HTTP, Jupyter")
            run.latency_us.update(single_client_latencies(floor, server, jupyter, args.cells))
            save()
            log("new sessions from the pool, import pandas, Terrarium")
            new_sessions(run, server, args.sessions)
            save()
            log("throughput")
            throughput_levels(run, floor, server, levels, args.ops, args.floor_max)
            save()
            log("memory per idle session")
            memory_per_session(run, server, "lean", 10)
            memory_per_session(run, server, "data", 3)
            run.memory["lean_outside_pss_mib"] = outside_memory("lean")
            run.memory["data_outside_pss_mib"] = outside_memory("data")
            save()
            if args.idle:
                log(f"holding {args.idle} idle sessions")
                idle_sessions_fit(run, server, args.idle)
            for profile in ("lean", "data"):
                for how, times in server.start_times_ms(profile).items():
                    run.samples_ms[f"pool_start_{profile}_{how}"] = times
    save()
    log("new sessions without a pool")
    with serving(base / "nopool", "--pool-size", "0", "--data-pool-size", "0") as server:
        run.samples_ms["new_session_miss"] = asyncio.run(
            new_sessions_missing(server, max(3, args.sessions // 4))
        )


def machine_facts() -> dict[str, Any]:
    meminfo = Path("/proc/meminfo").read_text()
    total = re.search(r"MemTotal:\s+(\d+)", meminfo)
    runsc = subprocess.run(["runsc", "--version"], capture_output=True, text=True).stdout
    return {
        "cpus": os.cpu_count(),
        "mem_total_gib": round(int(total[1]) / 1024 / 1024, 1) if total else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "runsc": runsc.splitlines()[0] if runsc else "?",
        "load_before": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


if __name__ == "__main__":
    sys.exit(main())
