"""The E2B SDK on cloche against cloche's own SDK, on one server, in one run.

    .venv/bin/python benchmarks/bench_e2b.py [--cells N] [--creates N] [--markdown FILE]

Measures, against a real server (gVisor backend) on a background thread of this process,
reached over HTTP on loopback:

1. `run_code("1+1")` through the E2B SDK (e2b-code-interpreter, `/e2b/execute`) against
   `session.run("1+1")` through cloche's SDK (`/v1/sessions/{id}/execute`), in alternating
   blocks (on a shared machine, latencies drift from minute to minute); the target is E2B's
   p50 at most 1.5x cloche's.
2. `commands.run("true")` through the E2B SDK (envd's Process service over Connect) against
   `POST /v1/sessions/{id}/commands` with httpx.
3. Create to first result: `Sandbox.create()` then `run_code("1+1")`, against
   `client.create_session()` then `run`, each from a warm pool (refilled between samples).

E2B's published figures go beside: ~150 ms to start a sandbox (E2B's documentation), and
create to first execution p50 442 ms (a third party's measurement of E2B's cloud).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from cleanup import leftovers, scratch_dir
from cloche.client.sync import Client
from cloche.config import ServerConfig
from cloche.server.app import Server

DEFAULT_RUNTIME_DIR = Path(sys.prefix).parent / ".runtime" / "site-packages"
TOKEN = "e2b_bench_token"  # noqa: S105  # the benchmark's own server
BLOCK = 25


class ServerThread:
    def __init__(self, config: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = Server(config)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 600) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout_s)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        self.call(self.server.start())
        self.call(self.server.manager.wait_ready("lean"))
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return (time.perf_counter() - start) * 1000


def stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50": statistics.median(ordered),
        "p90": ordered[int(len(ordered) * 0.9) - 1] if len(ordered) >= 10 else ordered[-1],
        "n": len(ordered),
    }


def alternate(a: Callable[[], object], b: Callable[[], object], n: int) -> tuple[list, list]:
    first: list[float] = []
    second: list[float] = []
    for _ in range(3):  # warm-up
        a()
        b()
    while len(first) < n:
        first += [timed(a) for _ in range(min(BLOCK, n - len(first)))]
        second += [timed(b) for _ in range(min(BLOCK, n - len(second)))]
    return first, second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with scratch_dir() as base:
        config = ServerConfig(
            tcp_port=0,
            http_port=0,
            backend="gvisor",
            pool_size=2,
            data_pool_size=0,
            state_dir=base / "state",
            data_dir=base / "data",
            runtime_dir=DEFAULT_RUNTIME_DIR if DEFAULT_RUNTIME_DIR.is_dir() else None,
            tokens=frozenset({TOKEN}),
        )
        config = replace(config, pool_max=0)
        with ServerThread(config) as running:
            assert running.server.http is not None
            port = running.server.http.port
            url = f"http://127.0.0.1:{port}/e2b"
            os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=TOKEN)
            rows = measure(f"http://127.0.0.1:{port}", running, args.cells, args.creates)
        left = leftovers(base)
    load_after = os.getloadavg()
    text = render(rows, load_before, load_after, args)
    print(text)
    if left:
        print("LEFT BEHIND:", *left, sep="\n  ", file=sys.stderr)
    if args.markdown:
        args.markdown.write_text(text)


def measure(base: str, running: ServerThread, cells: int, creates: int) -> list[tuple]:
    from e2b_code_interpreter import Sandbox

    rows = []
    with Client(base, token=TOKEN) as client:
        sandbox = Sandbox.create()
        session = client.create_session()
        e2b_cells, cloche_cells = alternate(
            lambda: sandbox.run_code("1+1"), lambda: session.run("1+1"), cells
        )
        rows.append(('`run_code("1+1")`, warm', e2b_cells, cloche_cells, None))
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=base, headers=headers, timeout=60) as http:
            path = f"/v1/sessions/{session.id}/commands"
            e2b_cmds, cloche_cmds = alternate(
                lambda: sandbox.commands.run("true"),
                lambda: http.post(path, json={"cmd": "true"}).raise_for_status(),
                max(20, cells // 4),
            )
        rows.append(('`commands.run("true")`', e2b_cmds, cloche_cmds, None))
        sandbox.kill()
        session.close()
        e2b_new: list[float] = []
        cloche_new: list[float] = []
        made: list[Any] = []

        def e2b_first() -> None:
            made.append(Sandbox.create())
            made[-1].run_code("1+1")

        def cloche_first() -> None:
            made.append(client.create_session())
            made[-1].run("1+1")

        for _ in range(creates):
            made.clear()

            running.call(running.server.manager.wait_ready("lean"))
            e2b_new.append(timed(e2b_first))
            running.call(running.server.manager.wait_ready("lean"))
            cloche_new.append(timed(cloche_first))
            made[0].kill()
            made[1].close()
        published = "442 (p50, E2B cloud, a third party's); ~150 to start (E2B's)"
        rows.append(("create -> first result (pool hit)", e2b_new, cloche_new, published))
    return rows


def render(rows: list[tuple], before: tuple, after: tuple, args: argparse.Namespace) -> str:
    lines = [
        f"`.venv/bin/python benchmarks/bench_e2b.py --cells {args.cells} --creates {args.creates}`",
        f"on {os.cpu_count()} cores; load average {before[0]:.1f} before, {after[0]:.1f} after.",
        "",
        "| operation | E2B SDK on cloche p50 / p90 (ms) | cloche SDK p50 / p90 (ms) "
        "| ratio (p50) | E2B published (ms) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, e2b, ours, published in rows:
        a, b = stats(e2b), stats(ours)
        lines.append(
            f"| {name} (n={a['n']}) | {a['p50']:.2f} / {a['p90']:.2f} | {b['p50']:.2f} / "
            f"{b['p90']:.2f} | {a['p50'] / b['p50']:.2f}x | {published or '-'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
