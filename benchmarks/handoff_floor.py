"""What a thread hand-off costs inside a gVisor sandbox: the floor under the kernel's router.

    sudo .venv/bin/python benchmarks/handoff_floor.py [--rounds 3] [-n 2000]

Since the process supervisor (issue 35) the kernel reads its channel in a thread of its own
(`kernel/router.py`), which hands each cell to the main thread. This measures that step
alone, inside one lean session of a test server: a child process sends a byte through a
pipe and waits for the answer; the main thread answers either after reading the pipe
itself ("direct", as the kernel did before) or after a reader thread read it and handed it
over a queue ("thread", as the router does), or with a byte through a pipe instead of the
queue ("pipe": whether another primitive is cheaper). The p50 and mean round trip as the child sees
it, and the main side's CPU per round trip (both threads), alternating in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import ServerThread, make_config  # noqa: E402

CELL = r"""
import json, os, queue, threading, time
def measure(kind, n):
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        times = []
        for _ in range(n):
            began = time.perf_counter()
            os.write(req_w, b"x")
            os.read(rep_r, 1)
            times.append(time.perf_counter() - began)
        os.write(out_w, json.dumps(times).encode())
        os._exit(0)
    for fd in (req_w, rep_r, out_w):
        os.close(fd)
    cpu = time.process_time()
    if kind == "direct":
        for _ in range(n):
            os.read(req_r, 1)
            os.write(rep_w, b"y")
    elif kind == "pipe":
        handed_r, handed_w = os.pipe()
        frames = []
        def reader():
            for _ in range(n):
                frames.append(os.read(req_r, 1))
                os.write(handed_w, b".")
        threading.Thread(target=reader, daemon=True).start()
        for _ in range(n):
            os.read(handed_r, 1)
            frames.pop()
            os.write(rep_w, b"y")
        os.close(handed_r)
        os.close(handed_w)
    else:
        handed = queue.SimpleQueue()
        def reader():
            for _ in range(n):
                handed.put(os.read(req_r, 1))
        threading.Thread(target=reader, daemon=True).start()
        for _ in range(n):
            handed.get()
            os.write(rep_w, b"y")
    cpu = time.process_time() - cpu
    chunks = []
    while chunk := os.read(out_r, 1 << 20):
        chunks.append(chunk)
    os.waitpid(pid, 0)
    for fd in (req_r, rep_w, out_r):
        os.close(fd)
    return {"kind": kind, "times": json.loads(b"".join(chunks)), "cpu_s": cpu / n}
KINDS = ("direct", "thread", "pipe")
print(json.dumps([measure(kind, N) for _ in range(ROUNDS) for kind in KINDS]))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-n", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cloche-handoff-") as scratch:
        with ServerThread(make_config(Path(scratch) / "state")) as server:
            base = f"http://127.0.0.1:{server.http_port}"
            with httpx.Client(base_url=base, timeout=600) as http:
                session = http.post("/v1/sessions", json={}).json()["id"]
                code = f"N, ROUNDS = {args.n}, {args.rounds}\n" + CELL
                reply = http.post(f"/v1/sessions/{session}/execute", json={"code": code}).json()
                http.delete(f"/v1/sessions/{session}")
    if reply.get("status") != "ok":
        print(reply, file=sys.stderr)
        return 1
    runs = json.loads(reply["stdout"])
    figures = {}
    for kind in ("direct", "thread", "pipe"):
        times = [t for run in runs if run["kind"] == kind for t in run["times"]]
        cpus = [run["cpu_s"] for run in runs if run["kind"] == kind]
        figures[kind] = (
            statistics.median(times) * 1e6,
            statistics.fmean(times) * 1e6,
            statistics.median(cpus) * 1e6,
        )
        p50, mean, cpu = figures[kind]
        print(f"{kind:6}: round trip p50 {p50:.1f} us, mean {mean:.1f} us; CPU {cpu:.1f} us")
    (d50, _, dcpu), (t50, _, tcpu) = figures["direct"], figures["thread"]
    print(f"the hand-off: +{t50 - d50:.1f} us p50 ({t50 / d50:.2f}x), CPU {tcpu / dcpu:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
