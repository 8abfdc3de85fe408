"""The Jupyter kernel gateway against cloche's TCP protocol and a local ipykernel (issue 24).

    .venv/bin/python benchmarks/bench_jupyter.py [--cells 400] [--starts 20] [--busy 100]
        [--seconds 10] [--rounds 3] [--out DIR]

Needs root and runsc (`./test.sh` installs them, and ipykernel with the dev tools). One
`cloche serve` child process in a scratch directory, and one unsandboxed ipykernel started
by jupyter_client, measured in the same run:

1. Warm cell: `1+1`, --cells cells in alternating batches of 50 over (a) the channels
   websocket of one cloche kernel (execute_request until its execute_reply and the iopub
   idle), (b) the TCP protocol in one session, (c) the local ipykernel through
   jupyter_client's blocking client (execute until its reply and idle). p50 and p99.
2. A kernel ready: `POST /api/kernels`, then a websocket and `kernel_info_request` until
   its reply (a pool hit each: the next start waits until the pool is full again), against
   starting a local ipykernel (`KernelManager.start_kernel` + `wait_for_ready`). p50.
3. Busy: --busy kernels, a websocket each, looping `i += 1` for --seconds, against --busy
   TCP sessions doing the same: aggregate cells/s. After a round of each that is not
   counted (the sandboxes' first thousand cells are slower), the two alternate --rounds
   times (A B A B); the ratio is the median of each round's.

The machine is shared: the load average is printed at the start and the end. Results go to
OUT/jupyter.json (every sample) and OUT/jupyter.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import websockets

from bench_cluster import Cells, percentile
from cleanup import scratch_dir
from serving import Serve, serving


def message(msg_type: str, content: dict[str, Any], session: str) -> tuple[str, str]:
    """A request's frame, and its msg_id."""
    msg_id = uuid.uuid4().hex
    header = {
        "msg_id": msg_id,
        "msg_type": msg_type,
        "session": session,
        "username": "bench",
        "version": "5.3",
    }
    text = json.dumps(
        {
            "header": header,
            "parent_header": {},
            "metadata": {},
            "content": content,
            "channel": "shell",
            "buffers": [],
        }
    )
    return text, msg_id


class Channels:
    """One websocket to a cloche kernel; requests wait for their reply and the iopub idle."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.session = uuid.uuid4().hex

    async def open(self) -> None:
        self.socket = await websockets.connect(self.url, max_size=None)

    async def request(self, msg_type: str, content: dict[str, Any]) -> dict[str, Any]:
        text, msg_id = message(msg_type, content, self.session)
        await self.socket.send(text)
        reply: dict[str, Any] | None = None
        idle = False
        while reply is None or not idle:
            incoming = json.loads(await self.socket.recv())
            if incoming.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = incoming["header"]["msg_type"]
            if kind.endswith("_reply"):
                reply = incoming
            elif kind == "status" and incoming["content"]["execution_state"] == "idle":
                idle = True
        return reply

    async def run(self, code: str) -> None:
        reply = await self.request("execute_request", {"code": code, "silent": False})
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"cell failed: {reply['content']}")

    async def close(self) -> None:
        await self.socket.close()


async def new_kernel(http: httpx.AsyncClient, ws_base: str) -> tuple[str, Channels]:
    made = await http.post("/api/kernels", json={"name": "python3"})
    assert made.status_code == 201, made.text
    kernel_id: str = made.json()["id"]
    channels = Channels(f"{ws_base}/api/kernels/{kernel_id}/channels")
    await channels.open()
    return kernel_id, channels


async def warm_cells(server: Serve, count: int) -> dict[str, list[float]]:
    from jupyter_client.manager import start_new_kernel

    samples: dict[str, list[float]] = {"websocket": [], "tcp": [], "local ipykernel": []}
    ws_base = f"ws://127.0.0.1:{server.http_port}"
    async with httpx.AsyncClient(base_url=server.target.url, timeout=120) as http:
        kernel_id, channels = await new_kernel(http, ws_base)
        tcp = Cells(server.tcp_port)
        await tcp.open()
        manager, local = start_new_kernel(kernel_name="python3")
        try:

            async def websocket_cell() -> None:
                await channels.run("1+1")

            async def tcp_cell() -> None:
                await tcp.run("1+1")

            async def local_cell() -> None:
                local.execute_interactive("1+1", timeout=60, output_hook=lambda _: None)

            runners = {
                "websocket": websocket_cell,
                "tcp": tcp_cell,
                "local ipykernel": local_cell,
            }
            for run in runners.values():
                for _ in range(20):  # warm up
                    await run()
            for _ in range(max(1, count // 50)):
                for name, run in runners.items():
                    for _ in range(50):
                        started = time.perf_counter()
                        await run()
                        samples[name].append((time.perf_counter() - started) * 1000)
        finally:
            local.stop_channels()
            manager.shutdown_kernel(now=True)
            await tcp.close()
            await channels.close()
            await http.delete(f"/api/kernels/{kernel_id}")
    return samples


async def pool_full(http: httpx.AsyncClient, wanted: int) -> bool:
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith('cloche_sessions_pooled{profile="lean"}'):
            return float(line.split()[-1]) >= wanted
    return False


async def kernel_starts(server: Serve, count: int, pool: int) -> dict[str, list[float]]:
    from jupyter_client.manager import KernelManager

    samples: dict[str, list[float]] = {"cloche kernel": [], "local ipykernel": []}
    ws_base = f"ws://127.0.0.1:{server.http_port}"
    async with httpx.AsyncClient(base_url=server.target.url, timeout=120) as http:
        for _ in range(count):
            until = time.monotonic() + 120
            while not await pool_full(http, pool) and time.monotonic() < until:  # noqa: ASYNC110
                await asyncio.sleep(0.05)  # the pool refills between two starts
            started = time.perf_counter()
            kernel_id, channels = await new_kernel(http, ws_base)
            await channels.request("kernel_info_request", {})
            samples["cloche kernel"].append((time.perf_counter() - started) * 1000)
            await channels.close()
            await http.delete(f"/api/kernels/{kernel_id}")
    for _ in range(max(1, count // 4)):  # ~1 s each
        manager = KernelManager(kernel_name="python3")
        started = time.perf_counter()
        manager.start_kernel()
        client = manager.blocking_client()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        samples["local ipykernel"].append((time.perf_counter() - started) * 1000)
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return samples


async def busy(server: Serve, sessions: int, seconds: float, rounds: int) -> dict[str, Any]:
    ws_base = f"ws://127.0.0.1:{server.http_port}"
    async with httpx.AsyncClient(base_url=server.target.url, timeout=300) as http:
        kernels = [await new_kernel(http, ws_base) for _ in range(sessions)]
        tcp = [Cells(server.tcp_port) for _ in range(sessions)]
        for client in tcp:
            await client.open()
        for (_, channels), client in zip(kernels, tcp, strict=True):
            await channels.run("i = 0")
            await client.run("i = 0")

        async def loop(run: Any, counts: list[int], index: int, stop_at: float) -> None:
            while time.monotonic() < stop_at:
                await run("i += 1")
                counts[index] += 1

        phases = {"websocket": [c.run for _, c in kernels], "tcp": [c.run for c in tcp]}
        rates: dict[str, list[float]] = {name: [] for name in phases}
        for round_ in range(rounds + 1):  # A B A B: the machine's load drifts over a run
            for name, runners in phases.items():
                counts = [0] * sessions
                started = time.monotonic()
                stop_at = started + seconds
                await asyncio.gather(*(loop(r, counts, i, stop_at) for i, r in enumerate(runners)))
                rate = sum(counts) / (time.monotonic() - started)
                if round_:  # the first round warms the sandboxes up, and is not counted
                    rates[name].append(rate)
                print(f"{sessions} busy over {name}: {rate:.0f} cells/s", flush=True)
        results = {name: statistics.median(rate) for name, rate in rates.items()}
        results["ratios"] = [w / t for w, t in zip(rates["websocket"], rates["tcp"], strict=True)]
        for kernel_id, channels in kernels:
            await channels.close()
            await http.delete(f"/api/kernels/{kernel_id}")
        for client in tcp:
            await client.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", type=int, default=400)
    parser.add_argument("--starts", type=int, default=20)
    parser.add_argument("--busy", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3, help="busy phases per front end")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"load_start": os.getloadavg()}
    pool = 2
    with scratch_dir() as base:
        serve_args = ["--pool-size", str(pool), "--data-pool-size", "0", "--max-sessions", "250"]
        with serving(base / "server", *serve_args, "--data-dir", str(base / "data")) as server:
            results["warm_ms"] = asyncio.run(warm_cells(server, args.cells))
            for name, samples in results["warm_ms"].items():
                print(f"warm cell {name}: p50 {statistics.median(samples):.3f} ms", flush=True)
            results["start_ms"] = asyncio.run(kernel_starts(server, args.starts, pool))
            for name, samples in results["start_ms"].items():
                print(f"ready {name}: p50 {statistics.median(samples):.1f} ms", flush=True)
            results["busy"] = asyncio.run(busy(server, args.busy, args.seconds, args.rounds))
    results["load_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "jupyter.json").write_text(json.dumps(results, indent=1))
    text = report(results, args)
    (args.out / "jupyter.md").write_text(text)
    print(text)
    return 0


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    warm = {k: statistics.median(v) for k, v in results["warm_ms"].items()}
    warm99 = {k: percentile(v, 0.99) for k, v in results["warm_ms"].items()}
    start = {k: statistics.median(v) for k, v in results["start_ms"].items()}
    busy = results["busy"]
    faster = warm["local ipykernel"] / warm["websocket"]
    ratio = statistics.median(busy["ratios"])

    def verdict(met: bool) -> str:
        return "met" if met else "missed"

    rows = [
        ("warm `1+1`, websocket p50 / p99", f"{warm['websocket']:.3f} / "
         f"{warm99['websocket']:.3f} ms", "≤ 1.5 ms", verdict(warm["websocket"] <= 1.5)),
        ("warm `1+1`, TCP protocol p50 / p99", f"{warm['tcp']:.3f} / {warm99['tcp']:.3f} ms",
         "", ""),
        ("warm `1+1`, local ipykernel p50 / p99", f"{warm['local ipykernel']:.3f} / "
         f"{warm99['local ipykernel']:.3f} ms", "", ""),
        ("local ipykernel / websocket", f"{faster:.2f}x", "≥ 3x", verdict(faster >= 3)),
        ("kernel ready (POST + kernel_info), p50", f"{start['cloche kernel']:.1f} ms",
         "≤ 15 ms", verdict(start["cloche kernel"] <= 15)),
        ("local ipykernel start, p50", f"{start['local ipykernel']:.0f} ms", "", ""),
        (f"{args.busy} busy kernels: websocket / TCP cells/s", f"{busy['websocket']:.0f} / "
         f"{busy['tcp']:.0f} (median ratio {ratio:.2f})", "≥ 0.8", verdict(ratio >= 0.8)),
    ]  # fmt: skip
    table = "\n".join("| " + " | ".join(row) + " |" for row in rows)
    load = results["load_start"][0], results["load_end"][0]
    return (
        f"# The Jupyter kernel gateway\n\n`.venv/bin/python benchmarks/bench_jupyter.py "
        f"--cells {args.cells} --starts {args.starts} --busy {args.busy} --seconds "
        f"{args.seconds:g} --rounds {args.rounds}`, one run; load average {load[0]:.1f} at "
        f"the start, {load[1]:.1f} at the end; {os.cpu_count()} cores.\n\n"
        f"| measure | figure | target | verdict |\n"
        f"|---|---|---|---|\n{table}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
