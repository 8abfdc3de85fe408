"""A session as a computer (issue 35's targets), against `cloche serve` in one run:

    .venv/bin/python benchmarks/bench_computer.py [--quick] [--image-tar PATH] [--out DIR]

Needs root, runsc and (without --image-tar) mmdebstrap. One `cloche serve` child process
(free ports, --pool-size 2, its own --state-dir, --data-dir and --templates-dir in a scratch
directory removed at the end) with a template `debian` built from a Debian minbase tarball
with python3. Each figure beside its baseline or floor, measured in the same run:

(a) a new session from the template's warm pool (`POST /v1/sessions` alone, p50; target
    <= 5 ms), beside a new lean session from its pool;
(b) a command's round trip (`true` through the login shell, and /bin/true executed
    directly) beside a cell's (`1+1`) in the same session (target: <= 2x the cell), and
    the floors: the same relay to the supervisor starting no process (listing commands),
    and fork, fork+exec of /bin/true timed inside the sandbox from a cell;
(c) pause, resume (the first cell after the pause) and fork of one copy, for a session
    whose root wrote 100 MiB into its system layer beside one that wrote nothing;
(d) a keystroke echoed through a terminal over the websocket (p50; target <= 2 ms), beside
    a cell's round trip and the echo of gVisor's pty timed inside the sandbox.

All times are a client's over HTTP or the websocket unless they say "inside". The machine is
shared: the load average is noted at the start and the end. Results: OUT/computer.json
(every sample), OUT/computer.md (the tables) and OUT/computer-serve.log (the server's log).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from cleanup import foreign_runsc, leftovers, scratch_dir
from computer_parts import (
    IDLE_DIRECT,
    IDLE_SHELL,
    LAYER_MIB,
    TEMPLATE,
    Api,
    Samples,
    build_template,
    commands,
    debian_tarball,
    dump,
    durability,
    keystrokes,
    log,
    new_sessions,
)
from serving import serving

POOL_SIZE = 2
PARTS = ("sessions", "commands", "durability", "terminal")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few samples of each")
    parser.add_argument("--image-tar", type=Path, help="a root tarball (default: mmdebstrap)")
    parser.add_argument("--parts", default=",".join(PARTS), help="a subset of " + ",".join(PARTS))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    args.parts = set(args.parts.split(","))
    if not args.parts <= set(PARTS):
        parser.error("--parts takes " + ", ".join(PARTS))
    if args.image_tar is not None and not args.image_tar.is_file():
        parser.error(f"--image-tar {args.image_tar}: no such file")
    args.sessions, args.commands, args.rounds, args.keys = (
        (4, 40, 2, 40) if args.quick else (20, 200, 5, 200)
    )
    return args


def p90(values: list[float]) -> float:
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def fmt(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def verdicts(samples: Samples) -> list[list[str]]:
    """[target, measured, verdict] for issue 35's targets."""

    def row(target: str, measured: float, limit: float, shown: str) -> list[str]:
        if math.isnan(measured):
            return [target, "-", "NO SAMPLE"]
        ok = measured <= limit
        return [target, shown, "met" if ok else f"MISSED ({measured / limit:.1f}x the target)"]

    new = samples.p50(f"new session (template {TEMPLATE}) from its pool")
    cell = samples.p50("cell `1+1`")
    shell = samples.p50("command `true` (bash -lc)")
    direct = samples.p50("command /bin/true, args (no shell)")
    idle_shell = samples.p50(IDLE_SHELL)
    idle_direct = samples.p50(IDLE_DIRECT)
    keys = samples.p50("keystroke echo through the terminal (websocket)")
    return [
        row("new template session from the pool p50 <= 5 ms", new, 5.0, f"{fmt(new)} ms"),
        row(
            "command `true` p50 <= 2x a cell's (same session)",
            shell / cell,
            2.0,
            f"{shell / cell:.1f}x ({fmt(shell)} / {fmt(cell)} ms)",
        ),
        row(
            "command /bin/true (args, no shell) p50 <= 2x a cell's",
            direct / cell,
            2.0,
            f"{direct / cell:.1f}x ({fmt(direct)} / {fmt(cell)} ms)",
        ),
        row(
            "the same, a leader ready (idle before): `true`",
            idle_shell / cell,
            2.0,
            f"{idle_shell / cell:.1f}x ({fmt(idle_shell)} / {fmt(cell)} ms)",
        ),
        row(
            "the same, a leader ready (idle before): /bin/true",
            idle_direct / cell,
            2.0,
            f"{idle_direct / cell:.1f}x ({fmt(idle_direct)} / {fmt(cell)} ms)",
        ),
        row("terminal keystroke echo p50 <= 2 ms", keys, 2.0, f"{fmt(keys)} ms"),
    ]


def measurement_rows(samples: Samples) -> list[list[str]]:
    baselines = {
        "new session": "new session (lean) from its pool",
        "command": "cell `1+1`",
        "list commands": "cell `1+1`",
        "inside, from a cell: ": "cell `1+1`",
        "keystroke": "cell `1+1` (same session, HTTP)",
        "pause (": "pause (empty layer)",
        "resume": "resume: first cell after the pause (empty layer)",
        "fork of": "fork of 1 copy (empty layer)",
        "fork:": "fork: the copy's first cell (empty layer)",
    }
    rows = []
    for what, values in samples.ms.items():
        base = next((b for prefix, b in baselines.items() if what.startswith(prefix)), None)
        ratio = samples.p50(what) / samples.p50(base) if base and base != what else math.nan
        rows.append(
            [
                what,
                str(len(values)),
                fmt(statistics.median(values)),
                fmt(p90(values)),
                fmt(min(values)),
                "-" if math.isnan(ratio) else f"{ratio:.2f}x",
            ]
        )
    return rows


def table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    cells = [header, *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    else:
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def render(samples: Samples, notes: list[str], markdown: bool) -> str:
    header = ["what (ms)", "n", "p50", "p90", "min", "p50 / baseline"]
    return "\n\n".join(
        [
            table(["target", "measured", "verdict"], verdicts(samples), markdown),
            table(header, measurement_rows(samples), markdown),
            "\n".join(("- " if markdown else "") + note for note in notes),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if os.geteuid() != 0 or shutil.which("runsc") is None:
        print("bench_computer: needs root and runsc on PATH", file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    samples = Samples()
    with scratch_dir() as base:
        foreign = set(foreign_runsc(base))
        tarball = args.image_tar or debian_tarball(base / "debian.tar")
        with serving(
            base / "state",
            "--pool-size",
            str(POOL_SIZE),
            "--data-pool-size",
            "0",
            "--data-dir",
            str(base / "data"),
            "--templates-dir",
            str(base / "templates"),
            "--cell-timeout",
            "300",
            # Cells keep their turn: the floors timed inside a cell (forks, spawns, a pty's
            # echo) measure gVisor, not a long cell put behind the host's processes.
            "--cell-slice",
            "3600",
        ) as server:
            api = Api(server)
            build_template(api, tarball)
            for part, measure, count in (
                ("sessions", lambda n: new_sessions(api, samples, n, POOL_SIZE), args.sessions),
                ("commands", lambda n: commands(api, samples, n), args.commands),
                ("durability", lambda n: durability(api, samples, n), args.rounds),
                ("terminal", lambda n: keystrokes(api, samples, n), args.keys),
            ):
                if part in args.parts:
                    try:
                        measure(count)
                    except Exception as exc:  # noqa: BLE001 - reported, and the rest runs
                        samples.notes.append(f"PART {part} NOT FINISHED: {exc}")
                        log(f"PART {part} FAILED: {exc}")
            api.close_all()
            api.http.close()
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(server.log_path, args.out / "computer-serve.log")
        foreign.update(foreign_runsc(base))
        left = leftovers(base)
    load_end = os.getloadavg()
    samples.notes += [
        f"Run {started_at}, {os.cpu_count()} cores; load average (1/5/15 min) "
        f"{'/'.join(f'{x:.1f}' for x in load_start)} at the start, "
        f"{'/'.join(f'{x:.1f}' for x in load_end)} at the end; {len(foreign)} runsc "
        f"processes of others seen: the machine was {'NOT ' if load_start[0] > 1.5 else ''}quiet.",
        f"Layer: {LAYER_MIB} MiB of random bytes written by root into /usr/local.",
        "p50 / baseline: against a new lean session, the cell `1+1` of the same session, or the "
        "empty-layer session, measured in the same run.",
    ]
    print(render(samples, samples.notes, markdown=False))
    dump(samples, args.out / "computer.json")
    (args.out / "computer.md").write_text(render(samples, samples.notes, markdown=True) + "\n")
    log(f"written: {args.out / 'computer.json'}, {args.out / 'computer.md'}")
    if left:
        print("WARNING: this run left things behind:\n  " + "\n  ".join(left), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
