"""`cloche bench`: load a running server and report latency percentiles and throughput.

Like redis-benchmark: point it at a server, choose workloads, get p50/p90/p99/max and
operations per second (with a progress bar on a terminal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any
from urllib.parse import urlsplit

import httpx

from cloche.bench import (
    WORKLOADS,
    Progress,
    Report,
    Target,
    http_client,
    measure,
    render,
    server_workers,
)
from cloche.client.aio import default_token, default_url
from cloche.commands.common import CLOCHE_FAILED, CODE_FAILED, add_connection_options
from cloche.errors import ClocheError


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure a running server's latency and throughput",
        description="Run workloads against a running cloche server and print p50/p90/p99/max "
        "latency (ms) and operations per second. Workloads: "
        + "; ".join(f"{name}: {what}" for name, what in WORKLOADS.items())
        + ". Exit status 1 when any operation failed.",
    )
    add_connection_options(parser)
    parser.add_argument(
        "--tcp",
        default=os.environ.get("CLOCHE_TCP"),
        metavar="HOST:PORT",
        help="the server's TCP protocol address, for tcp-cell [env CLOCHE_TCP; default: "
        "the HTTP host, port 8000]",
    )
    parser.add_argument(
        "-w",
        "--workload",
        action="append",
        choices=list(WORKLOADS),
        help="what to run (repeat for several) [default: tcp-cell]",
    )
    parser.add_argument("-n", "--requests", type=int, default=1000, help="timed operations")
    parser.add_argument(
        "-c",
        "--clients",
        type=levels,
        default=[1],
        metavar="N[,N...]",
        help="concurrent clients (sessions); several levels, such as 1,10,50,100, are run in "
        "turn and printed as a scaling table [default 1]",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed operations first [default: n/10]"
    )
    parser.add_argument("--code", default="1+1", help="the cell each operation runs")
    parser.add_argument("--profile", default="lean", help="session profile [default lean]")
    parser.add_argument(
        "--pause",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="rest between one client's operations (to let a warm pool refill)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per workload")
    parser.set_defaults(handler=_bench)


def levels(text: str) -> list[int]:
    """Concurrency levels: "10" or "1,10,50,100"."""
    try:
        numbers = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a number or a comma-separated list of numbers: {text!r}"
        ) from None
    if not numbers or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"every level must be at least 1: {text!r}")
    return numbers


def target_of(args: argparse.Namespace) -> Target:
    url = (args.url or default_url()).rstrip("/")
    if args.tcp:
        host, _, port = args.tcp.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--tcp wants HOST:PORT, not {args.tcp!r}")
        tcp_host, tcp_port = host, int(port)
    else:
        tcp_host, tcp_port = urlsplit(url).hostname or "127.0.0.1", 8000
    return Target(
        url=url,
        tcp_host=tcp_host,
        tcp_port=tcp_port,
        token=args.token or default_token(),
        profile=args.profile,
        code=args.code,
    )


async def run_workloads(
    target: Target,
    workloads: list[str],
    *,
    requests: int,
    clients: int | list[int],
    warmup: int,
    pause_s: float,
    timeout_s: float,
) -> list[Report]:
    """Each workload at each concurrency level in turn."""
    counts = [clients] if isinstance(clients, int) else clients
    reports = []
    async with http_client(target, max(counts), timeout_s) as http:
        for workload in workloads:
            for count in counts:
                reports.append(
                    await measure(
                        workload,
                        server_workers(workload, target, http),
                        total=requests,
                        concurrency=count,
                        warmup=warmup,
                        pause_s=pause_s,
                        progress=Progress(f"{workload} -c {count}", requests),
                    )
                )
    return reports


def _bench(args: argparse.Namespace) -> int:
    if args.requests < 1:
        print("cloche bench: --requests must be at least 1", file=sys.stderr)
        return CLOCHE_FAILED
    try:
        target = target_of(args)
        reports = asyncio.run(
            run_workloads(
                target,
                args.workload or ["tcp-cell"],
                requests=args.requests,
                clients=args.clients,
                warmup=args.warmup if args.warmup is not None else args.requests // 10,
                pause_s=args.pause,
                timeout_s=args.request_timeout,
            )
        )
    except (ValueError, OSError) as exc:
        print(f"cloche bench: {exc}", file=sys.stderr)
        return CLOCHE_FAILED
    except (ClocheError, httpx.HTTPError) as exc:  # set-up failed: refused, unreachable
        print(f"cloche bench: could not start the workload: {exc}", file=sys.stderr)
        return CLOCHE_FAILED
    except KeyboardInterrupt:
        return 130
    if args.json:
        for report in reports:
            print(json.dumps(report.summary()))
    else:
        print(render(reports, scaling=len(args.clients) > 1))
        for report in reports:
            if report.first_error:
                print(f"{report.name}: first error: {report.first_error}", file=sys.stderr)
    return CODE_FAILED if any(report.errors for report in reports) else 0
