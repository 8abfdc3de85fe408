"""Cluster mode against one machine, in one run (issue 14's targets).

    .venv/bin/python benchmarks/bench_cluster.py [--nodes 3] [--cells 400] [--creates 20]
        [--busy 50] [--seconds 10] [--out DIR]

Needs root, runsc and Ray (`scripts/install.sh --cluster`). Two `cloche serve` child
processes in a scratch directory: a single server, and a front end over a local Ray cluster
of --nodes nodes on this same machine (so the cluster has no more cores than the single
server: its aggregate can only show the cost of the extra hop, not a gain). Measured:

1. Cluster start: from `cloche serve --cluster local:N` to listening (Ray's processes, the
   directory, N node agents with their pools).
2. Warm cell: one TCP session each, `1`, --cells cells in alternating batches of 50 on the
   two servers (same run, same load): p50 and p99, and the difference of the p50s.
3. New session over HTTP (`POST /v1/sessions`, a ready pool sandbox each time: the next
   create waits until the pools are full again): p50, single and cluster.
4. Aggregate cells/s with --busy sessions, each a client looping `i += 1` for --seconds.
5. Node failure: kill -9 one node agent holding sessions; the time until a request to one
   of its sessions is answered "lost" (410), and until GET /v1/cluster says dead.
6. Ray's token authentication (issue 23): two more local clusters, the default (token)
   and --cluster-insecure (none), side by side: warm cell and new session on each,
   alternating batches as in 2. `--auth-only` runs this part alone (cluster-auth.md).

The machine is shared: the load average is noted at the start and the end. Results go to
OUT/cluster.json (every sample) and OUT/cluster.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cleanup import scratch_dir
from serving import Serve, serving

HEADER = struct.Struct(">I")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Cells:
    """One TCP connection of the REPL protocol, one session, cells timed from the client."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.session: str | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        await self._receive()  # the greeting

    async def run(self, code: str) -> dict[str, Any]:
        message: dict[str, Any] = {"code": code}
        if self.session is not None:
            message["session_id"] = self.session
        body = json.dumps(message).encode()
        self.writer.write(HEADER.pack(len(body)) + body)
        reply = await self._receive()
        if reply.get("status") != "ok":
            raise RuntimeError(f"cell failed: {reply}")
        self.session = reply["session_id"]
        return reply

    async def _receive(self) -> dict[str, Any]:
        (length,) = HEADER.unpack(await self.reader.readexactly(HEADER.size))
        reply: dict[str, Any] = json.loads(await self.reader.readexactly(length))
        return reply

    async def close(self) -> None:
        self.writer.close()


async def warm_cells(servers: dict[str, Serve], count: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in servers}
    clients = {name: Cells(server.tcp_port) for name, server in servers.items()}
    for client in clients.values():
        await client.open()
        for _ in range(20):  # warm up: the session made, the paths hot
            await client.run("1")
    for _ in range(max(1, count // 50)):
        for name, client in clients.items():
            for _ in range(50):
                started = time.perf_counter()
                await client.run("1")
                samples[name].append((time.perf_counter() - started) * 1000)
    for client in clients.values():
        await client.close()
    return samples


def pools_full(http: httpx.Client, cluster: bool) -> bool:
    if cluster:
        return all(n["pool"].get("lean", 0) >= 2 for n in http.get("/v1/cluster").json()["nodes"])
    text = http.get("/metrics").text
    for line in text.splitlines():
        if line.startswith('cloche_sessions_pooled{profile="lean"}'):
            return float(line.split()[-1]) >= 2
    return False


def new_sessions(server: Serve, count: int, cluster: bool) -> list[float]:
    samples = []
    with httpx.Client(base_url=server.target.url, timeout=120) as http:
        for _ in range(count):
            until = time.monotonic() + 120
            while not pools_full(http, cluster) and time.monotonic() < until:
                time.sleep(0.05)  # the pools refill between two creates (a pool hit each)
            started = time.perf_counter()
            response = http.post("/v1/sessions", json={})
            samples.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 201, response.text
            http.delete(f"/v1/sessions/{response.json()['id']}")
    return samples


async def busy(server: Serve, sessions: int, seconds: float) -> dict[str, float]:
    clients = [Cells(server.tcp_port) for _ in range(sessions)]
    for client in clients:
        await client.open()
        await client.run("i = 0")
    counts = [0] * sessions
    latencies: list[float] = []
    stop_at = time.monotonic() + seconds

    async def loop(index: int) -> None:
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            await clients[index].run("i += 1")
            latencies.append((time.perf_counter() - started) * 1000)
            counts[index] += 1

    started = time.monotonic()
    await asyncio.gather(*(loop(i) for i in range(sessions)))
    elapsed = time.monotonic() - started
    for client in clients:
        await client.close()
    return {
        "cells_per_s": sum(counts) / elapsed,
        "p50_ms": statistics.median(latencies),
        "p99_ms": percentile(latencies, 0.99),
    }


def node_failure(cluster: Serve, sessions: int) -> dict[str, float]:
    with httpx.Client(base_url=cluster.target.url, timeout=120) as http:
        ids = [http.post("/v1/sessions", json={}).json()["id"] for _ in range(sessions)]
        for session_id in ids:
            http.post(f"/v1/sessions/{session_id}/execute", json={"code": "x = 1"})
        until = time.monotonic() + 60
        while True:
            nodes = http.get("/v1/cluster").json()["nodes"]
            if sum(n["sessions"] for n in nodes) >= sessions or time.monotonic() > until:
                break
            time.sleep(0.05)
        victim = max((n for n in nodes if n["state"] == "alive"), key=lambda n: n["sessions"])
        killed = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        lost_after = dead_after = None
        while lost_after is None or dead_after is None:
            if time.monotonic() - killed > 60:
                break
            if lost_after is None:
                for session_id in ids:
                    code = http.post(
                        f"/v1/sessions/{session_id}/execute", json={"code": "x"}
                    ).status_code
                    if code == 410:
                        lost_after = time.monotonic() - killed
                        break
            if dead_after is None:
                states = {n["id"]: n["state"] for n in http.get("/v1/cluster").json()["nodes"]}
                if states[victim["id"]] == "dead":
                    dead_after = time.monotonic() - killed
        return {
            "lost_answer_s": lost_after if lost_after is not None else float("nan"),
            "dead_in_view_s": dead_after if dead_after is not None else float("nan"),
            "victim_sessions": victim["sessions"],
        }


def token_against_none(base: Path, args: argparse.Namespace, common: list[str]) -> dict[str, Any]:
    """Warm cells and new sessions on a local cluster with Ray's token auth (the default)
    and one without (--cluster-insecure), side by side."""
    found: dict[str, Any] = {}
    nodes = ("--cluster", f"local:{args.nodes}")
    with (
        serving(base / "token", *nodes, *common, "--data-dir", str(base / "token-data")) as token,
        serving(
            base / "none",
            *nodes,
            "--cluster-insecure",
            *common,
            "--data-dir",
            str(base / "none-data"),
        ) as none,
    ):
        servers = {"token": token, "no token": none}
        found["warm_ms"] = asyncio.run(warm_cells(servers, args.cells))
        found["create_ms"] = {
            name: new_sessions(server, args.creates, cluster=True)
            for name, server in servers.items()
        }
    for name in servers:
        print(f"{name}: warm cell p50 {statistics.median(found['warm_ms'][name]):.3f} ms, "
              f"new session p50 {statistics.median(found['create_ms'][name]):.1f} ms",
              flush=True)  # fmt: skip
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--cells", type=int, default=400)
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--busy", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--auth-only", action="store_true", help="only 6: token against none")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    results: dict[str, Any] = {"nodes": args.nodes, "load_start": load_start}
    common = ["--pool-size", "2", "--data-pool-size", "0", "--max-sessions", "200"]
    if args.auth_only:
        with scratch_dir() as base:
            results["auth"] = token_against_none(base, args, common)
        results["load_end"] = os.getloadavg()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cluster-auth.json").write_text(json.dumps(results, indent=1))
        text = auth_report(results, args)
        (args.out / "cluster-auth.md").write_text(text)
        print(text)
        return 0
    with scratch_dir() as base:
        single_args = [*common, "--data-dir", str(base / "single-data")]
        cluster_args = [*common, "--data-dir", str(base / "cluster-data")]
        with serving(base / "single", *single_args) as single:
            started = time.monotonic()
            with serving(
                base / "cluster", "--cluster", f"local:{args.nodes}", *cluster_args
            ) as cluster:
                results["cluster_start_s"] = time.monotonic() - started
                print(f"cluster of {args.nodes} nodes listening after "
                      f"{results['cluster_start_s']:.1f} s", flush=True)  # fmt: skip
                warm = asyncio.run(warm_cells({"single": single, "cluster": cluster}, args.cells))
                results["warm_ms"] = warm
                for name, samples in warm.items():
                    print(f"warm cell {name}: p50 {statistics.median(samples):.3f} ms "
                          f"p99 {percentile(samples, 0.99):.3f} ms", flush=True)  # fmt: skip
                results["create_ms"] = {
                    "single": new_sessions(single, args.creates, cluster=False),
                    "cluster": new_sessions(cluster, args.creates, cluster=True),
                }
                for name, samples in results["create_ms"].items():
                    print(f"new session {name}: p50 {statistics.median(samples):.1f} ms",
                          flush=True)  # fmt: skip
                results["busy"] = {}
                for name, server in (("single", single), ("cluster", cluster)):
                    results["busy"][name] = asyncio.run(busy(server, args.busy, args.seconds))
                    print(f"{args.busy} busy sessions {name}: {results['busy'][name]}",
                          flush=True)  # fmt: skip
                results["failure"] = node_failure(cluster, 6)
                print(f"node failure: {results['failure']}", flush=True)
            results["auth"] = token_against_none(base, args, common)
    results["load_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster.json").write_text(json.dumps(results, indent=1))
    (args.out / "cluster.md").write_text(report(results, args))
    print(report(results, args))
    return 0


def verdict(met: bool) -> str:
    return "met" if met else "missed"


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    warm = {k: statistics.median(v) for k, v in results["warm_ms"].items()}
    warm99 = {k: percentile(v, 0.99) for k, v in results["warm_ms"].items()}
    create = {k: statistics.median(v) for k, v in results["create_ms"].items()}
    single, cluster = results["busy"]["single"], results["busy"]["cluster"]
    failure = results["failure"]
    extra = warm["cluster"] - warm["single"]
    ratio = cluster["cells_per_s"] / single["cells_per_s"]
    command = (
        f"`.venv/bin/python benchmarks/bench_cluster.py --nodes {args.nodes} --cells "
        f"{args.cells} --creates {args.creates} --busy {args.busy} --seconds {args.seconds:g}`"
    )
    rows = [
        ("warm cell p50 (TCP, `1`)", f"{warm['single']:.3f} ms",
         f"{warm['cluster']:.3f} ms (+{extra:.3f} ms)", "≤ +0.5 ms", verdict(extra <= 0.5)),
        ("warm cell p99", f"{warm99['single']:.3f} ms", f"{warm99['cluster']:.3f} ms", "", ""),
        ("new session p50 (HTTP, a pool hit)", f"{create['single']:.1f} ms",
         f"{create['cluster']:.1f} ms", "≤ 10 ms", verdict(create["cluster"] <= 10)),
        (f"{args.busy} busy sessions: cells/s", f"{single['cells_per_s']:.0f}",
         f"{cluster['cells_per_s']:.0f} ({ratio:.2f}x)", "(same cores)", ""),
        (f"{args.busy} busy sessions: p50 / p99", f"{single['p50_ms']:.1f} / "
         f"{single['p99_ms']:.1f} ms", f"{cluster['p50_ms']:.1f} / {cluster['p99_ms']:.1f} ms",
         "", ""),
        ("cluster start, to listening", "", f"{results['cluster_start_s']:.1f} s", "", ""),
        ("node killed -9: its sessions answer lost", "", f"{failure['lost_answer_s']:.2f} s",
         "≤ 5 s", verdict(failure["lost_answer_s"] <= 5)),
        ("node killed -9: dead in GET /v1/cluster", "", f"{failure['dead_in_view_s']:.2f} s",
         "", ""),
    ]  # fmt: skip
    table = "\n".join("| " + " | ".join(row) + " |" for row in rows)
    load = results["load_start"][0], results["load_end"][0]
    return (
        f"# Cluster mode against one machine\n\n{command}, one run; load average "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end; {os.cpu_count()} cores, both "
        f"servers on this machine (the cluster's {args.nodes} nodes share its cores).\n\n"
        f"| measure | single server | cluster ({args.nodes} local nodes) | target | verdict |\n"
        f"|---|---|---|---|---|\n{table}\n\n{auth_table(results, args)}"
    )


def auth_table(results: dict[str, Any], args: argparse.Namespace) -> str:
    auth = results["auth"]
    rows = "\n".join(
        f"| {name} | {statistics.median(auth['warm_ms'][name]):.3f} ms | "
        f"{percentile(auth['warm_ms'][name], 0.99):.3f} ms | "
        f"{statistics.median(auth['create_ms'][name]):.1f} ms |"
        for name in ("token", "no token")
    )
    ratio = statistics.median(auth["warm_ms"]["token"]) / statistics.median(
        auth["warm_ms"]["no token"]
    )
    return (
        f"Ray's token authentication: two local clusters of {args.nodes} nodes side by side, "
        f"the default (a token) and --cluster-insecure (none), cells in alternating batches:"
        f"\n\n| cluster | warm cell p50 | warm cell p99 | new session p50 |\n"
        f"|---|---|---|---|\n{rows}\n\nwarm cell p50, token / none: {ratio:.3f}x\n"
    )


def auth_report(results: dict[str, Any], args: argparse.Namespace) -> str:
    load = results["load_start"][0], results["load_end"][0]
    return (
        f"# Ray's token authentication on a local cluster\n\n`.venv/bin/python "
        f"benchmarks/bench_cluster.py --auth-only --nodes {args.nodes} --cells {args.cells} "
        f"--creates {args.creates}`, one run; load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end.\n\n{auth_table(results, args)}"
    )


if __name__ == "__main__":
    sys.exit(main())
