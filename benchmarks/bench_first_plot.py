"""The first plot of a fresh lean session, with the font list shipped and without it.

    .venv/bin/python benchmarks/bench_first_plot.py [--sessions N]

Needs root and runsc. One `cloche serve` child process (its own --state-dir in a scratch
directory removed at the end); N fresh lean sessions one after another, alternately:

- shipped: the session as it starts, its MPLCONFIGDIR holding the runtime's font list
  (`cloche.sandbox.fonts`);
- rebuilt: the same, with MPLCONFIGDIR pointed at an empty directory first, as every
  session was before the list was shipped: matplotlib scans the fonts and writes its list.

Each session's first cell imports matplotlib, then its font manager (timed inside the
cell: wall time, and CPU time with fc-list's), then pyplot, plots with a title and ends
(the figure is shown as a PNG): the cell's time is the server's `duration_ms`, so the
session's creation is not in it. CPU time is the figure that a busy machine changes least.
The load average is noted at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import httpx

from bench_core import foreign_runsc, leftovers, scratch_dir
from suite import Serve

# The font list's part, timed inside: matplotlib itself first (numpy with it), then its
# font manager (which reads the list, or builds it), in wall and CPU time (its fc-list too).
PLOT = """import os, time
import matplotlib
def spent():
    t = os.times()
    return time.perf_counter(), t.user + t.system + t.children_user + t.children_system
wall, cpu = spent()
import matplotlib.font_manager
after_wall, after_cpu = spent()
print((after_wall - wall) * 1000, (after_cpu - cpu) * 1000)
import matplotlib.pyplot as plt
plt.plot([1, 3, 2]); plt.title('first')
plt.show()
"""
EMPTY_CONFIG = "import os\nos.environ['MPLCONFIGDIR'] = '/tmp/mpl-empty'\n"
KINDS = {"shipped": PLOT, "rebuilt": EMPTY_CONFIG + PLOT}


def first_plot(http: httpx.Client, code: str) -> tuple[float, float, float]:
    """The first cell's time, and its font manager's wall and CPU time (ms)."""
    session = http.post("/v1/sessions", json={"profile": "lean"}).json()["id"]
    try:
        reply = http.post(f"/v1/sessions/{session}/execute", json={"code": code, "timeout": 300})
        body = reply.json()
        if body["status"] != "ok" or not any("image/png" in r for r in body["displays"]):
            raise RuntimeError(f"the plot failed: {body}")
        fonts_wall, fonts_cpu = (float(x) for x in body["stdout"].split())
        return float(body["duration_ms"]), fonts_wall, fonts_cpu
    finally:
        http.delete(f"/v1/sessions/{session}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=20, help="of each kind (20)")
    args = parser.parse_args()
    if os.geteuid() != 0 or shutil.which("runsc") is None:
        print("bench_first_plot: needs root and runsc on PATH", file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    times: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in KINDS}
    with scratch_dir() as base:
        foreign = foreign_runsc(base)
        server = Serve(base / "state", "--pool-size", "2", "--cell-timeout", "300")
        try:
            with httpx.Client(base_url=server.target.url, timeout=600) as http:
                for _ in range(args.sessions):
                    for kind, code in KINDS.items():
                        times[kind].append(first_plot(http, code))
        finally:
            server.process.terminate()
            server.process.wait(120)
        left = leftovers(base)
    load_end = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores")
    print(f"load average at the start {load_start[0]:.2f}, at the end {load_end[0]:.2f}")
    print(f"runsc processes of others seen at the start: {len(foreign)}")
    for kind, samples in times.items():
        for i, what in enumerate(("first cell", "font manager", "font manager CPU")):
            values = [sample[i] for sample in samples]
            quartiles = statistics.quantiles(values, n=4)
            print(
                f"{kind:8} {what:17} ms: median {statistics.median(values):6.0f}  "
                f"p25 {quartiles[0]:6.0f}  p75 {quartiles[2]:6.0f}  max {max(values):6.0f}  "
                f"(n={len(values)})"
            )
    if left:
        print("LEFT BEHIND:", *left, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
