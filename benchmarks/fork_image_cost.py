"""What one more Python process costs a paused session: gVisor's anonymous memory and the
checkpoint image, against a session without it, in one run of one test server.

    sudo .venv/bin/python benchmarks/fork_image_cost.py [--rounds 3]

Each round pauses two fresh lean sessions in turn: one as it is (the kernel and its
process supervisor), and one whose cell first forked a child that only waits on a pipe.
Printed: the AnonPages of gVisor's /proc/meminfo inside each before the pause, and the
checkpoint image on disk, with the medians' ratio. Why: two helpers forked from the kernel
(the supervisor and the ports' relay, until 6 December) made the pause image 3.6x larger
than at commit 0ea4e1f (BENCHMARKS.md, "Forks, pauses and restarts").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import ServerThread, make_config  # noqa: E402

ANON = "int(next(l for l in open('/proc/meminfo') if l.startswith('AnonPages')).split()[1])"
FORK = """
import os
_r, _w = os.pipe()
if os.fork() == 0:
    os.read(_r, 1)
    os._exit(0)
"""


def paused(http: httpx.Client, data_dir: Path, fork: bool) -> tuple[int, int]:
    """A new session (with a waiting child if fork), paused: (AnonPages KiB, image bytes)."""
    session = http.post("/v1/sessions", json={}).json()["id"]
    try:
        if fork:
            done = http.post(f"/v1/sessions/{session}/execute", json={"code": FORK}).json()
            assert done["status"] == "ok", done
        anon = http.post(f"/v1/sessions/{session}/execute", json={"code": ANON}).json()
        assert http.post(f"/v1/sessions/{session}/pause").status_code == 200
        [image] = (p for p in data_dir.rglob("image") if p.parent.name == session)
        size = sum(f.stat().st_size for f in image.iterdir())
        return int(anon["result"]["text/plain"]), size
    finally:
        http.delete(f"/v1/sessions/{session}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cloche-forkcost-", dir="/var/tmp") as scratch:
        config = make_config(Path(scratch) / "state", pool_size=1, data_pool_size=0)
        seen: dict[bool, list[tuple[int, int]]] = {False: [], True: []}
        with ServerThread(config) as server:
            base = f"http://127.0.0.1:{server.http_port}"
            with httpx.Client(base_url=base, timeout=300) as http:
                for _ in range(args.rounds):
                    for fork in (False, True):
                        seen[fork].append(paused(http, Path(config.data_dir), fork))
        for fork, label in ((False, "as it is"), (True, "+1 forked child")):
            anon = statistics.median(a for a, _ in seen[fork])
            image = statistics.median(i for _, i in seen[fork])
            print(f"{label:16} AnonPages {anon / 1024:6.1f} MiB  image {image / 2**20:5.2f} MiB")
        ratio = statistics.median(i for _, i in seen[True]) / statistics.median(
            i for _, i in seen[False]
        )
        print(f"image with the child / without: {ratio:.2f}x (medians of {args.rounds})")


if __name__ == "__main__":
    main()
