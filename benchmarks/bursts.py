"""Bursts of one-shot Terrarium requests against `cloche serve` with its default settings:
N requests at once, each sleeping 1 s in a fresh sandbox. The issue's targets: 8 in under
3 s in all, 32 in under 10 s, every request in a sandbox of its own.

    sudo .venv/bin/python benchmarks/bursts.py [--bursts 8,8,32,32] [--rest 5]

Each burst is timed from the first request sent to the last answer. Each request writes a
marker file and says whether it found one already there (a reused working directory would).
Between bursts the server rests `--rest` seconds (pools refill and grow meanwhile, as they
would between a user's bursts). The first burst meets the pool as `cloche serve` leaves it
at start: one ready data sandbox, once it is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import serving  # noqa: E402

CODE = (
    "import os, time\n"
    "seen = os.path.exists('marker')\n"
    "open('marker', 'w').write('x')\n"
    "time.sleep(1)\n"
    "seen"
)


async def burst(url: str, size: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        began = time.perf_counter()
        replies = await asyncio.gather(*(http.post("/", json={"code": CODE}) for _ in range(size)))
        took = time.perf_counter() - began
    bodies = [reply.json() for reply in replies]
    failed = [b for b in bodies if not b.get("success")]
    reused = [b for b in bodies if b.get("final_expression") is not False]
    return {
        "size": size,
        "total_s": round(took, 2),
        "failed": len(failed),
        "reused_workdir": len(reused) - len(failed),
        "load_average_1min": round(os.getloadavg()[0], 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", default="8,8,32,32", help="burst sizes, in order")
    parser.add_argument("--rest", type=float, default=5.0, help="seconds between bursts")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cloche-bursts-") as scratch:
        with serving(Path(scratch) / "state") as server:
            server.wait_pooled("data", 1)
            for size in (int(s) for s in args.bursts.split(",")):
                row = asyncio.run(burst(server.target.url, size))
                rows.append(row)
                print(json.dumps(row), flush=True)
                time.sleep(args.rest)  # the rest between a user's bursts, not a wait for a state
    return 0 if all(r["failed"] == 0 and r["reused_workdir"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
