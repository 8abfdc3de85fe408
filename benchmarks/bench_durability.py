"""Durability: snapshot, pause, resume, restore and fork, a restart with live sessions, and
page-out to disk, against `cloche serve` in one run (issue 12's targets).

    .venv/bin/python benchmarks/bench_durability.py [--lean N] [--data N] [--restart N]
        [--page-out M] [--wake K] [--out DIR]

Needs root and runsc. Each part runs its own `cloche serve` child process (free ports, its
own --state-dir and --data-dir in a scratch directory removed at the end):

1. Latencies, for a lean session and a data session (`--data-pool-size 1`, profile "data"),
   all from the client's side over HTTP: a warm cell (the baseline, same session, same run),
   snapshot, pause, the first cell after the pause (it resumes the session), restore (a new
   session from the snapshot, then its first cell), fork of 1 copy and of 10 copies; and the
   size of an image (a snapshot's `size_bytes`; the bytes a paused session holds under
   --data-dir/sessions/<id>).
2. Restart: N live lean sessions, each holding a value; SIGTERM (the server pauses them all)
   to exit; a new server on the same --data-dir: start to listening, and to all N answering
   their first cell with their value.
3. Page-out: with --pause-idle 1, M idle lean sessions; MemAvailable before they are made
   and once /metrics says all M are paused; bytes on disk per paused session; then K of them
   woken, their values checked.

The machine is shared: the load average is noted at the start and the end. Results go to
OUT/durability.json (every sample) and OUT/durability.md (the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from cleanup import foreign_runsc, leftovers, scratch_dir
from durability_parts import (
    GIB,
    PageOutRun,
    ProfileRun,
    RestartRun,
    latencies,
    log,
    page_out,
    restart,
)
from durability_report import TARGET_HEADER, measurement_rows, render, verdicts


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--lean", type=int, default=10, help="rounds of the lean session (>= 10)")
    parser.add_argument("--data", type=int, default=3, help="rounds of the data session (>= 3)")
    parser.add_argument("--restart", type=int, default=100, help="live sessions at the restart")
    parser.add_argument(
        "--page-out", type=int, default=300, help="idle sessions paged out (2000: the target)"
    )
    parser.add_argument("--wake", type=int, default=20, help="paged-out sessions woken after")
    parser.add_argument(
        "--data-max-mib",
        type=int,
        default=60 * 1024,
        help="--data-dir budget of the page-out server",
    )
    parser.add_argument(
        "--parts",
        default="latency,restart,pageout",
        help="comma-separated subset of latency,restart,pageout",
    )
    parser.add_argument(
        "--resume-at-start",
        choices=("yes", "no"),
        default="yes",
        help="the restarted server's --resume-at-start (no: each session on its first cell)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= {"latency", "restart", "pageout"}:
        parser.error("--parts takes latency, restart and pageout")
    args.parts = parts
    if min(args.lean, args.data, args.restart, args.page_out, args.wake) < 0:
        parser.error("counts can't be negative")
    if "restart" in parts and args.restart < 1 or "pageout" in parts and args.page_out < 1:
        parser.error("--restart and --page-out need at least one session")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if os.geteuid() != 0 or shutil.which("runsc") is None:
        print("bench_durability: needs root and runsc on PATH", file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    foreign: set[str] = set()
    runs: list[ProfileRun] = []
    restarted: RestartRun | None = None
    paged: PageOutRun | None = None
    broken: list[str] = []  # parts that could not finish, and why
    with scratch_dir() as base:
        disk_free = shutil.disk_usage(base).free
        foreign.update(foreign_runsc(base))
        if "latency" in args.parts:
            with part_failing(broken, "latency"):
                runs = latencies(base, args.lean, args.data)
            foreign.update(foreign_runsc(base))
        if "restart" in args.parts:
            with part_failing(broken, "restart"):
                restarted = restart(base, args.restart, args.resume_at_start)
            foreign.update(foreign_runsc(base))
        if "pageout" in args.parts:
            with part_failing(broken, "pageout"):
                paged = page_out(base, args.page_out, args.wake, args.data_max_mib)
            foreign.update(foreign_runsc(base))
        left = leftovers(base)
    if base.exists():
        left.append(f"directory: {base}")
    load_end = os.getloadavg()

    verdict_rows = verdicts(runs, restarted, paged, disk_free)
    rows = measurement_rows(runs, restarted, paged)
    notes = [
        f"Run {started_at}, {os.cpu_count()} cores, MemTotal {mem_total_gib():.1f} GiB, "
        f"{disk_free / GIB:.0f} GiB free on the scratch disk.",
        f"Load average (1/5/15 min) at the start {fmt_load(load_start)}, at the end "
        f"{fmt_load(load_end)}; {len(foreign)} runsc processes of others were seen: the machine "
        f"was {'NOT ' if foreign or load_start[0] > 1.5 else ''}quiet.",
        "All times are a client's, over HTTP (keep-alive) to `cloche serve` as a child process.",
    ]
    if restarted is not None:
        notes.append(
            f"Restart: {restarted.shutdown_pauses} of {restarted.sessions} sessions logged "
            f"`session paused reason=shutdown`; {len(restarted.first_cell_ms)} answered their "
            "first cell with their value."
        )
    if restarted is not None and restarted.failures:
        notes.append(f"Restart: {len(restarted.failures)} failed: " + "; ".join(restarted.failures))
    if paged is not None and paged.failures:
        notes.append(f"Page-out: {len(paged.failures)} failed: " + "; ".join(paged.failures))
    notes += [f"PART NOT FINISHED: {why}" for why in broken]
    for run in runs:
        notes.append(
            f"{run.profile}: {run.rounds_ok} of the rounds ended with the original session "
            f"answering; {len(run.failures)} steps failed"
            + (": " + "; ".join(run.failures) if run.failures else ".")
        )
    print()
    print(render(verdict_rows, rows, notes, markdown=False))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "durability.md").write_text(render(verdict_rows, rows, notes, markdown=True))
    raw = {
        "started_at": started_at,
        "arguments": {
            k: sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
        },
        "machine": {
            "cores": os.cpu_count(),
            "mem_total_gib": mem_total_gib(),
            "kernel": platform.release(),
        },
        "load_average_start": load_start,
        "load_average_end": load_end,
        "foreign_runsc_processes_seen": len(foreign),
        "latency": [asdict(run) for run in runs],
        "restart": asdict(restarted) if restarted is not None else None,
        "page_out": asdict(paged) if paged is not None else None,
        "parts_not_finished": broken,
        "verdicts": [dict(zip(TARGET_HEADER, row, strict=True)) for row in verdict_rows],
    }
    (args.out / "durability.json").write_text(json.dumps(raw, indent=1) + "\n")
    print(f"(written: {args.out / 'durability.json'}, {args.out / 'durability.md'})")
    if left:
        print("\nWARNING: this run left things behind:\n  " + "\n  ".join(left), file=sys.stderr)
        return 1
    print("clean-up: nothing of this run left (no runsc process, mount, cgroup or file)")
    return 0


@contextmanager
def part_failing(broken: list[str], part: str) -> Iterator[None]:
    """A part that fails is reported, and the others still run."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - reported in the results, not hidden
        broken.append(f"{part}: {type(exc).__name__}: {exc}")
        log(f"PART {part} FAILED: {exc}")


def fmt_load(load: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.2f}" for x in load)


def mem_total_gib() -> float:
    match = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    return int(match[1]) / 1024 / 1024 if match else 0.0


if __name__ == "__main__":
    sys.exit(main())
