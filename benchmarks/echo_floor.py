"""The floor side by side: a line echoed through `runsc do` and through cloche's own bundle
(CommandSandbox: cloche's rootfs, mounts, limits, cgroup and runsc flags), in alternating
blocks of one run: whether a setting of cloche's bundle costs every round trip.

    sudo .venv/bin/python benchmarks/echo_floor.py [--blocks 10] [--block 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

from floor import ECHO_LOOP, WARMUP_S, Echo, Floor, wait_ready


class DoEcho:
    """The echo loop under `runsc do` (the host's root as the sandbox's, default flags)."""

    def __init__(self, root: Path, python: str, platform: str) -> None:
        self.process = subprocess.Popen(
            [
                "runsc", "--root", str(root), "--network=none", f"--platform={platform}",
                "do", python, "-S", "-c", ECHO_LOOP,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )  # fmt: skip
        assert self.process.stdout is not None and self.process.stdin is not None
        wait_ready(self.process.stdout, "runsc do", timeout_s=60.0)
        self.echo = Echo(self.process.stdin, self.process.stdout)

    def close(self) -> None:
        streams: list[IO[bytes] | None] = [self.process.stdin, self.process.stdout]
        for stream in streams:
            if stream is not None:
                stream.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def alternate(echoes: dict[str, Echo], blocks: int, block: int) -> dict[str, list[float]]:
    for echo in echoes.values():
        echo.warm_up(200, WARMUP_S)
    samples: dict[str, list[float]] = {name: [] for name in echoes}
    for _ in range(blocks):
        for name, echo in echoes.items():
            samples[name] += echo.timed(block)
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_us": statistics.median(ordered),
        "p90_us": ordered[int(0.9 * len(ordered))],
        "p99_us": ordered[int(0.99 * len(ordered))],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--block", type=int, default=200)
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="cloche-echo-") as scratch,
        Floor(Path(scratch) / "floor") as floor,
    ):
        assert floor.echo is not None and floor.backend.runsc is not None
        platform = floor.backend.runsc.platform
        do = DoEcho(Path(scratch) / "do-root", floor.backend.python, platform)
        try:
            samples = alternate(
                {"runsc do": do.echo, "cloche bundle": floor.echo}, args.blocks, args.block
            )
        finally:
            do.close()
        for name, values in samples.items():
            results[name] = summary(values)
    results["facts"] = {"platform": platform, "load_average_1min": os.getloadavg()[0]}
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
