"""Write and read throughput in a volume against the session's own disk (issue 37).

    .venv/bin/python benchmarks/bench_volumes.py [--mib 128] [--files 2000] [--rounds 3]
        [--out DIR]

Needs root and runsc (`./test.sh` installs them). One `cloche serve` child process with a
session whose disk (--disk-mib) holds the test file, mounting a volume at /home/user/vol
(its cells keep their turn, `--cell-slice 3600`: a long cell is not put behind the host's
processes, which on a loaded machine would measure the scheduler instead of the storage),
measured in one run, each figure the best and the median of --rounds rounds, the two
places taken in turn (A B A B) so that the machine's swings fall on both:

1. Sequential write of --mib MiB in 1 MiB pieces, without and with an fsync at the end
   (the session's disk is a tmpfs: its fsync costs nothing; a volume's goes to the host's
   disk through its loop device), then a sequential read of it (warm: from the host's
   page cache; dropping the caches would disturb the machine's other users).
2. Small files: --files files of 4 KiB written, then read, then removed; operations/s.

(The same code run on the host is no baseline here: the sandboxes' cgroups weigh more for
the CPU than the host's processes, which a loaded machine starves.)

The machine is shared: the load average is printed at the start and the end. Results go to
OUT/volumes.json and OUT/volumes.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cleanup import scratch_dir  # noqa: E402
from serving import serving  # noqa: E402

# Runs in the session: probe(where, mib, files) answers a dict of timings.
PROBE = r"""
import json, os, sys, time
def probe(where, mib, files):
    piece = os.urandom(1 << 20)
    path = os.path.join(where, "big.bin")
    out = {}
    for sync in (False, True):
        started = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(mib):
                f.write(piece)
            if sync:
                f.flush(); os.fsync(f.fileno())
        out["write_fsync" if sync else "write"] = mib / (time.perf_counter() - started)
    started = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    out["read"] = mib / (time.perf_counter() - started)
    os.unlink(path)
    small = os.path.join(where, "small")
    os.makedirs(small, exist_ok=True)
    block = b"s" * 4096
    started = time.perf_counter()
    for n in range(files):
        with open(os.path.join(small, str(n)), "wb") as f:
            f.write(block)
    out["small_write"] = files / (time.perf_counter() - started)
    started = time.perf_counter()
    for n in range(files):
        with open(os.path.join(small, str(n)), "rb") as f:
            f.read()
    out["small_read"] = files / (time.perf_counter() - started)
    started = time.perf_counter()
    for n in range(files):
        os.unlink(os.path.join(small, str(n)))
    out["small_remove"] = files / (time.perf_counter() - started)
    os.rmdir(small)
    return out
"""
MEASURES = {
    "write": "sequential write, MiB/s",
    "write_fsync": "sequential write + fsync, MiB/s",
    "read": "sequential read (warm), MiB/s",
    "small_write": "4 KiB files written, files/s",
    "small_read": "4 KiB files read, files/s",
    "small_remove": "4 KiB files removed, files/s",
}


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class Session:
    """The benchmark's session, reached over HTTP."""

    def __init__(self, url: str, volume: str, disk_mib: int) -> None:
        self.http = httpx.Client(base_url=url, timeout=900)
        made = self.http.post("/v1/volumes", json={"name": volume, "size_mib": disk_mib})
        made.raise_for_status()
        mount = {"name": volume, "path": "/home/user/vol"}
        self.id = self.http.post("/v1/sessions", json={"volumes": [mount]}).json()["id"]
        self.run(PROBE + "\n0")

    def run(self, code: str) -> Any:
        done = self.http.post(f"/v1/sessions/{self.id}/execute", json={"code": code}).json()
        if done["status"] != "ok":
            raise RuntimeError(f"the probe failed in the session: {done}")
        return done["result_json"]

    def probe(self, where: str, mib: int, files: int) -> dict[str, float]:
        result: dict[str, float] = self.run(f"probe({where!r}, {mib}, {files})")
        return result


def rounds(places: dict[str, Callable[[], dict[str, float]]], count: int) -> dict[str, Any]:
    """Each place measured count times, in turn; per place and measure, best and median."""
    seen: dict[str, list[dict[str, float]]] = {name: [] for name in places}
    for number in range(count):
        for name, measure in places.items():
            seen[name].append(measure())
            print(f"round {number + 1} {name}: {seen[name][-1]}", file=sys.stderr)
    return {
        name: {
            key: {
                "best": max(r[key] for r in results),
                "median": statistics.median(r[key] for r in results),
            }
            for key in MEASURES
        }
        for name, results in seen.items()
    }


def table(figures: dict[str, Any]) -> str:
    places = list(figures)
    lines = [
        "| measure | " + " | ".join(places) + " | volume / session disk |",
        "|---|" + "---|" * (len(places) + 1),
    ]
    for key, label in MEASURES.items():
        cells = [
            f"{figures[p][key]['median']:,.0f} (best {figures[p][key]['best']:,.0f})"
            for p in places
        ]
        ratio = figures["volume"][key]["median"] / figures["session disk"][key]["median"]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="size of the sequential file")
    parser.add_argument("--files", type=int, default=2000, help="small files per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    disk_mib = max(256, 2 * args.mib + 64)
    started_load = load()
    print(f"load average at the start: {started_load}", file=sys.stderr)
    with scratch_dir() as base:
        data = base / "data"
        server_args = (
            *("--data-dir", str(data), "--disk-mib", str(disk_mib), "--cell-slice", "3600"),
            *("--pool-size", "1", "--data-pool-size", "0"),
        )
        with serving(base / "state", *server_args, "--cell-timeout", "900") as server:
            session = Session(server.target.url, "bench", disk_mib)
            places: dict[str, Callable[[], dict[str, float]]] = {
                "session disk": lambda: session.probe("/home/user", args.mib, args.files),
                "volume": lambda: session.probe("/home/user/vol", args.mib, args.files),
            }
            figures = rounds(places, args.rounds)
            session.http.delete(f"/v1/sessions/{session.id}")
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": os.cpu_count(),
        "load_start": started_load,
        "load_end": load(),
        "mib": args.mib,
        "files": args.files,
        "rounds": args.rounds,
        "figures": figures,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "volumes.json").write_text(json.dumps(result, indent=2))
    text = (
        f"Volumes against the session's disk ({result['when']}, {result['cores']} cores, load "
        f"{result['load_start']} at the start, {result['load_end']} at the end; "
        f"{args.mib} MiB, {args.files} small files, median of {args.rounds} rounds)\n\n"
        + table(figures)
        + "\n"
    )
    (args.out / "volumes.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
