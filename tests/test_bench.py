"""`cloche bench` against a real gVisor server, and the figures it reports."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloche.bench import Report, Worker, measure, percentile, render
from support import ServerThread, make_config, require_gvisor

CLOCHE = Path(sys.executable).parent / "cloche"
TOKEN = "bench-token"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    require_gvisor()
    state = tmp_path_factory.mktemp("bench-state")
    with ServerThread(make_config(state, tokens=frozenset({TOKEN}), pool_size=2)) as running:
        yield running


def bench(api: ServerThread, *argv: str, token: str = TOKEN) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CLOCHE_")}
    environment["CLOCHE_TOKEN"] = token
    return subprocess.run(
        [
            str(CLOCHE),
            "bench",
            "--url",
            f"http://127.0.0.1:{api.http_port}",
            "--tcp",
            f"127.0.0.1:{api.tcp_port}",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )


def cells_ok(api: ServerThread) -> float:
    return api.server.manager.metrics.cells.labels("ok")._value.get()


def test_reports_each_workloads_figures_as_json(api: ServerThread) -> None:
    cells_before = cells_ok(api)
    done = bench(api, "-w", "tcp-cell", "-w", "http-cell", "-n", "30", "-c", "2", "--json")
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["workload"] for r in reports] == ["tcp-cell", "http-cell"]
    for report in reports:
        assert report["n"] == 30 and report["errors"] == 0 and report["concurrency"] == 2
        assert 0 < report["p50_ms"] <= report["p90_ms"] <= report["p99_ms"] <= report["max_ms"]
        assert report["throughput_per_s"] > 0
    # Every timed and warm-up cell really ran in a sandbox: 2 x (30 timed + 3 warm-up).
    assert cells_ok(api) - cells_before >= 66
    assert api.server.manager.list(TOKEN) == [], "bench left its sessions open"


def test_new_sessions_and_a_table(api: ServerThread) -> None:
    done = bench(api, "-w", "new-session", "-n", "3", "--warmup", "0", "--code", "6*7")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == [
        "workload", "clients", "n", "errors", "p50", "p90", "p99", "max", "ops/s"
    ]  # fmt: skip
    assert lines[2].split()[:4] == ["new-session", "1", "3", "0"]
    assert api.server.manager.list(TOKEN) == []


def test_new_sessions_over_tcp_in_one_request_each(api: ServerThread) -> None:
    created = api.server.manager.created
    done = bench(api, "-w", "tcp-new-session", "-n", "3", "--warmup", "0", "--json")
    assert done.returncode == 0, done.stderr
    (report,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert report["workload"] == "tcp-new-session" and report["errors"] == 0
    assert api.server.manager.created - created == 3
    assert api.server.manager.list(TOKEN) == [], "bench left its sessions open"


def test_failing_cells_are_counted_and_exit_1(api: ServerThread) -> None:
    done = bench(api, "-w", "tcp-cell", "-n", "5", "--warmup", "0", "--code", "1/0", "--json")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["errors"] == 5 and report["n"] == 0
    assert "ZeroDivisionError" in report["first_error"]


def test_a_wrong_token_is_a_clear_error(api: ServerThread) -> None:
    done = bench(api, "-n", "5", token="wrong")
    assert done.returncode == 2
    assert "401" in done.stderr and "Traceback" not in done.stderr


def test_an_unreachable_server_is_a_clear_error(api: ServerThread) -> None:
    done = subprocess.run(
        [str(CLOCHE), "bench", "--url", "http://127.0.0.1:9", "-n", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "could not start the workload" in done.stderr and "Traceback" not in done.stderr


# -- the measuring loop, with workers of its own -------------------------------------------


class Counting(Worker):
    def __init__(self, log: list[str], fail_every: int = 0) -> None:
        self.log = log
        self.fail_every = fail_every
        self.calls = 0

    async def open(self) -> None:
        self.log.append("open")

    async def once(self) -> float:
        self.calls += 1
        await asyncio.sleep(0)
        if self.fail_every and self.calls % self.fail_every == 0:
            from cloche.bench import BenchError

            raise BenchError("planned failure")
        return 0.001 * self.calls

    async def close(self) -> None:
        self.log.append("close")


def test_measure_spreads_operations_over_workers_and_counts_errors() -> None:
    log: list[str] = []
    workers: list[Counting] = []

    def make() -> Counting:
        workers.append(Counting(log, fail_every=4))
        return workers[-1]

    report = asyncio.run(measure("t", make, total=40, concurrency=4, warmup=8))
    assert log.count("open") == 4 and log.count("close") == 4
    assert sum(w.calls for w in workers) == 48  # 8 warm-up + 40 timed
    assert report.errors + len(report.samples_s) == 40
    assert report.errors > 0 and report.first_error == "BenchError: planned failure"
    assert report.wall_s > 0 and report.throughput == len(report.samples_s) / report.wall_s


def test_percentiles_and_table() -> None:
    samples = [i / 1000 for i in range(1, 101)]
    assert percentile(samples, 50) == pytest.approx(0.0505)
    assert percentile([0.002], 99) == 0.002
    with pytest.raises(ValueError):
        percentile([], 50)
    report = Report("w", 3, samples_s=samples, errors=1, wall_s=2.0)
    assert report.summary()["p99_ms"] == pytest.approx(99.01)
    table = render([report]).splitlines()
    assert table[2].split() == [
        "w",
        "3",
        "100",
        "1",
        "50.500",
        "90.100",
        "99.010",
        "100.000",
        "50.0",
    ]


def test_several_levels_in_one_call_print_a_scaling_table(api: ServerThread) -> None:
    done = bench(api, "-w", "tcp-cell", "-n", "20", "-c", "1,4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == [
        *("workload", "clients", "n", "errors", "p50", "p90", "p99", "max", "ops/s"),
        *("vs", "first"),
    ]
    rows = [line.split() for line in lines[2:]]
    assert [(row[0], row[1], row[2], row[3]) for row in rows] == [
        ("tcp-cell", "1", "20", "0"),
        ("tcp-cell", "4", "20", "0"),
    ]
    assert rows[0][-1] == "1.00x" and rows[1][-1].endswith("x")


def test_a_bad_level_list_is_refused_clearly(api: ServerThread) -> None:
    done = bench(api, "-c", "1,ten")
    assert done.returncode == 2
    assert "comma-separated list of numbers" in done.stderr


def test_http_workers_each_have_a_client_of_their_own_and_close_it() -> None:
    """One pool shared by 100 workers cost the bench 5.7-7.2 ms of its own CPU per request,
    so it measured itself; each worker holds one connection of its own instead."""
    import socket

    import httpx

    from cloche.bench import Target, server_workers

    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    target = Target(url=f"http://127.0.0.1:{port}")
    made: list[Worker] = []

    async def run() -> None:
        async with httpx.AsyncClient(base_url=target.url) as shared:
            make = server_workers("terrarium", target, shared)

            def tracked() -> Worker:
                made.append(make())
                return made[-1]

            report = await measure("t", tracked, total=6, concurrency=3)
            assert report.errors == 6 and "ConnectError" in (report.first_error or "")
            clients = [worker.http for worker in made]  # type: ignore[attr-defined]
            assert len({id(client) for client in clients}) == 3
            assert all(client is not shared and client.is_closed for client in clients)
            assert not shared.is_closed

    asyncio.run(run())
    for workload in ("http-cell", "new-session"):
        shared = httpx.AsyncClient(base_url=target.url)
        workers = [server_workers(workload, target, shared)() for _ in range(2)]
        owned = [worker.sessions.http for worker in workers]  # type: ignore[attr-defined]
        assert owned[0] is not owned[1] and shared not in owned
        for client in [*owned, shared]:
            asyncio.run(client.aclose())
