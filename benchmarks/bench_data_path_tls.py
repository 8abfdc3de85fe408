"""The cost of mutual TLS on the cluster's data path (issue 26): the same front-end link to
the same agent handler, in clear and over TLS 1.3, in one run.

    .venv/bin/python benchmarks/bench_data_path_tls.py [--calls 4000] [--mib 64] [--out DIR]

No Ray, no sandbox: an `AgentServer` answering at once on 127.0.0.1 and an `AgentLink`, as
the cluster's front end and node agent use them, so that what differs is only the TLS (a
warm cell over a cluster is this round trip plus the node's own cell). Measured, alternating
batches of 200 between the two links (same load):

1. Round trip of a small request (a cell's `execute` with its reply, ~300 bytes each way):
   p50 and p99, and the difference of the p50s (the warm-cell budget is +0.5 ms).
2. Throughput of 1 MiB replies (a file read through the data path): MiB/s.
3. Connection set-up: connect (TCP, the TLS handshake, the hello) p50.

Results go to OUT/data-path-tls.json and OUT/data-path-tls.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from cloche.cluster import tls
from cloche.cluster.link import AgentLink, AgentServer
from cloche.sessions.kernel import EventCallback

SECRET = "s" * 64
BATCH = 200
SMALL = {"code": "x = 1\n" * 20, "owner": None, "timeout_s": None, "silent": False}
CELL_REPLY = {"status": "ok", "streams": [["stdout", "1\n"]], "result": None, "displays": []}


async def handler(op: str, args: dict[str, Any], on_event: EventCallback) -> Any:
    if op == "stats":
        return {"seq": 1}
    if op == "read":
        return "x" * args["bytes"]
    return CELL_REPLY


async def link(port: int, context: Any) -> AgentLink:
    made = AgentLink(
        "node-a", "127.0.0.1", port, SECRET, lambda *_: None, lambda *_: None, tls=context
    )
    await made.connect()
    return made


async def measure(calls: int, mib: int) -> dict[str, Any]:
    ca = tls.make_ca()
    servers = {
        "clear": AgentServer("node-a", SECRET, handler),
        "tls": AgentServer(
            "node-a",
            SECRET,
            handler,
            tls=tls.AgentTLS.issue(ca, "node-a", "127.0.0.1").server_context(),
        ),
    }
    contexts = {"clear": None, "tls": tls.front_end_context(ca)}
    ports = {name: await server.start("127.0.0.1", 0) for name, server in servers.items()}
    found: dict[str, Any] = {
        name: {"rtt_ms": [], "connect_ms": [], "mib_s": []} for name in servers
    }
    try:
        for _ in range(20):  # connection set-up
            for name in servers:
                started = time.perf_counter()
                opened = await link(ports[name], contexts[name])
                found[name]["connect_ms"].append((time.perf_counter() - started) * 1000)
                opened.close()
        links = {name: await link(ports[name], contexts[name]) for name in servers}
        for opened in links.values():  # warm up
            for _ in range(100):
                await opened.call("execute", SMALL)
        for _ in range(max(1, calls // BATCH)):
            for name, opened in links.items():
                for _ in range(BATCH):
                    started = time.perf_counter()
                    await opened.call("execute", SMALL)
                    found[name]["rtt_ms"].append((time.perf_counter() - started) * 1000)
        for _ in range(3):
            for name, opened in links.items():
                started = time.perf_counter()
                for _ in range(mib):
                    await opened.call("read", {"bytes": 1 << 20})
                found[name]["mib_s"].append(mib / (time.perf_counter() - started))
        for opened in links.values():
            opened.close()
    finally:
        for server in servers.values():
            await server.close()
    return found


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    found = asyncio.run(measure(args.calls, args.mib))
    rows = []
    summary: dict[str, Any] = {"load_start": load_start, "load_end": os.getloadavg()}
    for name, values in found.items():
        rtt = values["rtt_ms"]
        summary[name] = {
            "rtt_p50_ms": statistics.median(rtt),
            "rtt_p99_ms": p(rtt, 99),
            "connect_p50_ms": statistics.median(values["connect_ms"]),
            "mib_s_best": max(values["mib_s"]),
        }
        rows.append(
            f"| {name} | {statistics.median(rtt):.3f} | {p(rtt, 99):.3f} | "
            f"{max(values['mib_s']):.0f} | {statistics.median(values['connect_ms']):.2f} |"
        )
    added = summary["tls"]["rtt_p50_ms"] - summary["clear"]["rtt_p50_ms"]
    summary["added_p50_ms"] = added
    table = "\n".join(
        [
            "| link | round trip p50 ms | p99 ms | 1 MiB replies, MiB/s (best of 3) "
            "| connect p50 ms |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"TLS adds {added:.3f} ms to the p50 round trip (budget +0.5 ms per warm cell); "
            f"throughput {summary['tls']['mib_s_best'] / summary['clear']['mib_s_best']:.2f}x "
            f"of clear. Load {load_start[0]:.2f} -> {summary['load_end'][0]:.2f}.",
        ]
    )
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "data-path-tls.json").write_text(json.dumps({"summary": summary, "raw": found}))
    (args.out / "data-path-tls.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
