"""How late a cluster front end's heartbeats come back when the machine is starved of CPU:
what the heartbeat's deadline (cloche.cluster.link.DEADLINE_S) is chosen from.

    .venv/bin/python benchmarks/bench_heartbeats.py [--hogs 16] [--seconds 60]
        [--sessions 6] [--mib 64] [--out DIR]

Needs root, runsc and Ray (`scripts/install.sh --cluster`). One front end (this process)
over a local 2-node Ray cluster on this machine, its deadline raised to 600 s so that no
node is declared dead while it is measured. Every heartbeat (a `stats` request on the data
path, sent 0.5 s after the last answer) is timed from the front end, in three phases:

1. idle: --seconds with nothing to do;
2. starved: the same with --hogs CPU hogs (`while True: pass`, each a process of its own,
   started here and killed by pid), the load average noted;
3. starved and draining: --sessions sessions of --mib MiB each on one node, drained to the
   other while the hogs run (what a pod's preStop does on a busy machine).

For each: the heartbeats' round trips (p50, p99, max) and the longest time between two
answers from a node (what a deadline must outlast), and the load average. The machine is
shared: other runs' load adds to the hogs'. Results go to OUT/heartbeats.json and
OUT/heartbeats.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cleanup import scratch_dir
from cloche.cluster import link
from cloche.cluster.link import AgentLink
from cloche.cluster.manager import ClusterSessionManager
from cloche.config import ServerConfig

HOG = "while True: pass"
DEFAULT_RUNTIME_DIR = Path(sys.prefix).parent / ".runtime" / "site-packages"


class Heartbeats:
    """Every heartbeat's round trip and the gaps between answers, by phase and node."""

    def __init__(self) -> None:
        self.phase = "start"
        self.trips: dict[str, list[float]] = {}
        self.gaps: dict[str, list[float]] = {}
        self._last: dict[str, float] = {}

    def install(self) -> None:
        original = AgentLink.call
        heartbeats = self

        async def timed(self: AgentLink, op: str, *args: Any, **kwargs: Any) -> Any:
            if op != "stats":
                return await original(self, op, *args, **kwargs)
            began = time.monotonic()
            answer = await original(self, op, *args, **kwargs)
            heartbeats.answered(self.node_id, began, time.monotonic())
            return answer

        AgentLink.call = timed  # type: ignore[method-assign]

    def answered(self, node_id: str, began: float, at: float) -> None:
        self.trips.setdefault(self.phase, []).append(at - began)
        last = self._last.get(node_id)
        if last is not None:
            self.gaps.setdefault(self.phase, []).append(at - last)
        self._last[node_id] = at


def start_hogs(count: int) -> list[subprocess.Popen[bytes]]:
    """count CPU hogs, each a process of its own (killed by pid at the end)."""
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(count)]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def load() -> float:
    return os.getloadavg()[0]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hogs", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    link.DEADLINE_S = 600.0  # measured, not declared dead
    heartbeats = Heartbeats()
    heartbeats.install()
    phases: dict[str, dict[str, Any]] = {}
    hogs: list[subprocess.Popen[bytes]] = []
    with scratch_dir() as base:
        config = ServerConfig(
            backend="gvisor",
            cluster="local:2",
            pool_size=1,
            data_pool_size=0,
            state_dir=base / "state",
            data_dir=base / "data",
            runtime_dir=DEFAULT_RUNTIME_DIR if DEFAULT_RUNTIME_DIR.is_dir() else None,
        )
        manager = ClusterSessionManager(config)
        await manager.start()
        try:
            await manager.wait_ready("lean", 600)

            async def phase(name: str, work: Any = None) -> None:
                heartbeats.phase = name
                began, load_before = time.monotonic(), load()
                done = await work if work is not None else None
                left = args.seconds - (time.monotonic() - began)
                if left > 0:
                    await asyncio.sleep(left)  # measuring for a time, not waiting for a thing
                phases[name] = {
                    "seconds": time.monotonic() - began,
                    "load_before": load_before,
                    "load_after": load(),
                    "work": done,
                }
                print(f"{name}: {summary(heartbeats, name)}, load {load():.1f}", flush=True)

            await phase("idle")
            hogs = await asyncio.to_thread(start_hogs, args.hogs)
            await phase("starved")
            heartbeats.phase = "starved-creating"  # big sessions made: not one of the phases
            made = []
            for _ in range(args.sessions):
                info = await manager.create()
                code = f"x = bytearray({args.mib} << 20); x[::4096] = b'1' * len(x[::4096])"
                await manager.execute(info.id, code)
                made.append(info.id)
            where = {manager._where[s] for s in made}
            source = max(where, key=lambda n: sum(1 for s in made if manager._where[s] == n))

            async def drain() -> dict[str, Any]:
                began = time.monotonic()
                report = await manager.drain(source, grace_s=600)
                return {**report, "drain_s": time.monotonic() - began}

            await phase("starved-draining", drain())
            for session_id in made:
                await manager.close(session_id)
        finally:
            for hog in hogs:
                os.kill(hog.pid, signal.SIGKILL)
                hog.wait()
            await manager.stop()
    results = {
        "hogs": args.hogs,
        "phases": phases,
        "trips": heartbeats.trips,
        "gaps": heartbeats.gaps,
        "deadline_s_then": 5.0,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "heartbeats.json").write_text(json.dumps(results, indent=1))
    lines = ["| phase | load | heartbeats | round trip p50 / p99 / max (s) | longest gap (s) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, facts in phases.items():
        trips = heartbeats.trips.get(name, [])
        gaps = heartbeats.gaps.get(name, [])
        lines.append(
            f"| {name} | {facts['load_before']:.1f} -> {facts['load_after']:.1f} | {len(trips)} "
            f"| {percentile(trips, 0.5):.3f} / {percentile(trips, 0.99):.3f} / "
            f"{max(trips, default=0):.3f} | {max(gaps, default=0):.3f} |"
        )
    (args.out / "heartbeats.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def summary(heartbeats: Heartbeats, name: str) -> str:
    trips = heartbeats.trips.get(name, [])
    gaps = heartbeats.gaps.get(name, [])
    return (
        f"{len(trips)} heartbeats, round trip p50 {percentile(trips, 0.5):.3f} s, "
        f"p99 {percentile(trips, 0.99):.3f} s, max {max(trips, default=0):.3f} s, "
        f"longest gap {max(gaps, default=0):.3f} s"
    )


if __name__ == "__main__":
    asyncio.run(main())
