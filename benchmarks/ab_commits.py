"""Commits' servers, measured in turn (A B A B ...) on one busy machine.

    .venv/bin/python benchmarks/ab_commits.py A_REV B_REV [C_REV ...] [--rounds N]
        [-n REQUESTS] [-w WORKLOAD ...] [--server-arg ARG ...]

Needs root and runsc. Each revision is checked out into a worktree of its own under a
scratch directory (removed at the end, with the worktrees); each round starts one
`cloche serve` per revision in turn, from that worktree's source (this virtualenv's
packages, its runtime), waits for its warm pool, runs `cloche bench -w WORKLOAD -n N` of
THIS tree against it (one client for both, so only the servers differ), and stops it.
Each round starts one revision later than the one before (A B, B A; A B C, B C A, ...).
The medians of the rounds' p50s are compared, each against the first revision's,
within the same time window, so that the machine's load, which changes by the minute on a
shared machine, weighs on both alike; the spread of the rounds says how far to trust them.
The server process's own CPU time per operation (from /proc) is printed too: a busy
machine changes it far less than latency. Each round runs each workload twice, N and 2N
operations: every run makes its own session, which the warm pool replaces by starting a
sandbox, so the CPU per operation is the difference of the two runs over the N operations
between them (start-ups cancel out); the latency is the 2N run's. (The sandboxes' own CPU
is not: a closed session's cgroup takes its count with it. benchmarks/handoff_floor.py
measures the in-sandbox step that changed.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 600.0


class Server:
    """`cloche serve` from a worktree's source, on free ports, its log in a file."""

    def __init__(self, source: Path, base: Path, extra: list[str]) -> None:
        base.mkdir(parents=True)
        self.log_path = base / "serve.log"
        env = {**os.environ, "PYTHONPATH": str(source / "src")}
        command = [
            sys.executable,
            "-m",
            "cloche.cli",
            "serve",
            "--tcp-port",
            "0",
            "--http-port",
            "0",
            "--state-dir",
            str(base / "state"),
            "--data-dir",
            str(base / "data"),
            "--data-pool-size",
            "0",
            *extra,
        ]
        with self.log_path.open("w") as log_file:
            self.process = subprocess.Popen(command, stderr=log_file, env=env, cwd=base)  # noqa: S603
        deadline = time.monotonic() + START_TIMEOUT_S
        pattern = r"listening tcp=\S+:(\d+) http=\S+:(\d+)"
        while not (match := re.search(pattern, self.log_path.read_text(errors="replace"))):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cloche serve did not start; see {self.log_path}")
            time.sleep(0.1)  # its log says its ports
        self.tcp_port, self.http_port = int(match[1]), int(match[2])

    def cpu_s(self) -> float:
        """The server process's own CPU time so far (user + system), s."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def bench(server: Server, workload: str, requests: int) -> dict[str, Any]:
    """One `cloche bench` run of this tree against the server: its JSON."""
    done = subprocess.run(  # noqa: S603
        [
            sys.executable,
            "-m",
            "cloche.cli",
            "bench",
            "--url",
            f"http://127.0.0.1:{server.http_port}",
            "--tcp",
            f"127.0.0.1:{server.tcp_port}",
            "-w",
            workload,
            "-n",
            str(requests),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=3600,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def report(name: str, revisions: list[str], values: dict[str, list[float]], unit: str) -> None:
    """Each revision's median of the rounds, against the first revision's."""
    first = values[revisions[0]]
    for rev in revisions:
        these = values[rev]
        line = (
            f"{name} {rev}: median of {len(these)} rounds {statistics.median(these):.3f} {unit} "
            f"(min {min(these):.3f}, max {max(these):.3f})"
        )
        if rev != revisions[0]:
            higher = sum(y > x for x, y in zip(first, these, strict=True))
            line += (
                f"; x{statistics.median(these) / statistics.median(first):.2f} of "
                f"{revisions[0]}, higher in {higher} of {len(these)} rounds"
            )
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("revisions", nargs="+", metavar="REV", help="two or more")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("-n", "--requests", type=int, default=2000)
    parser.add_argument("-w", "--workload", action="append", default=None)
    parser.add_argument("--server-arg", action="append", default=[], help="for both servers")
    args = parser.parse_args()
    if len(args.revisions) < 2:
        parser.error("name two revisions or more")
    workloads = args.workload or ["tcp-cell"]
    if os.geteuid() != 0 or shutil.which("runsc") is None:
        print("ab_commits: needs root and runsc on PATH", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="cloche-ab-"))
    trees: dict[str, Path] = {}
    p50s: dict[str, dict[str, list[float]]] = {}
    cpus: dict[str, dict[str, list[float]]] = {}
    try:
        for rev in args.revisions:
            tree = scratch / f"tree-{len(trees)}"
            subprocess.run(  # noqa: S603
                ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), rev],  # noqa: S607
                check=True,
            )
            trees[rev] = tree
            p50s[rev] = {w: [] for w in workloads}
            cpus[rev] = {w: [] for w in workloads}
        for round_ in range(args.rounds):
            turn = round_ % len(args.revisions)
            order = args.revisions[turn:] + args.revisions[:turn]
            for rev in order:
                server = Server(trees[rev], scratch / f"run-{round_}-{rev}", args.server_arg)
                try:
                    for workload in workloads:
                        # Each run makes a session, and the pool refills behind it: the CPU
                        # of a run of n and of 2n differ by n operations alone.
                        spent = []
                        for requests in (args.requests, 2 * args.requests):
                            cpu_before = server.cpu_s()
                            result = bench(server, workload, requests)
                            spent.append(server.cpu_s() - cpu_before)
                        operations = args.requests + args.requests // 10  # and the warm-up
                        cpu_ms = (spent[1] - spent[0]) * 1000 / operations
                        p50s[rev][workload].append(result["p50_ms"])
                        cpus[rev][workload].append(cpu_ms)
                        print(
                            f"round {round_} {rev} {workload} p50 {result['p50_ms']:.3f} ms, "
                            f"the server's CPU per operation {cpu_ms:.3f} ms "
                            f"(load {os.getloadavg()[0]:.1f})",
                            flush=True,
                        )
                finally:
                    server.stop()
    finally:
        for tree in trees.values():
            subprocess.run(  # noqa: S603
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],  # noqa: S607
                check=False,
            )
        shutil.rmtree(scratch, ignore_errors=True)
    for workload in workloads:
        report(f"{workload} p50", args.revisions, {r: p50s[r][workload] for r in p50s}, "ms")
        report(f"{workload} server CPU", args.revisions, {r: cpus[r][workload] for r in cpus}, "ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
