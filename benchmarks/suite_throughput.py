"""The suite's throughput: cells/s and p99 at each level of concurrent sessions, cloche's
against the floor's echo sandboxes (as many as the level).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from cloche.bench import HTTPSessions, TCPCell, Worker, http_client, measure
from floor import ECHO_LOOP, MESSAGE, CommandSandbox, Floor, wait_ready
from serving import Serve
from suite_run import DATA_POOL, POOL, Run, log


class EchoWorker(Worker):
    """The floor of a cell over many sessions: one echo sandbox per worker, driven by
    the same asyncio loop and measuring function as cloche's TCP workers."""

    def __init__(self, sandbox: CommandSandbox) -> None:
        self.sandbox = sandbox
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.WriteTransport | None = None

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.sandbox.stdout is not None and self.sandbox.stdin is not None
        self.reader = asyncio.StreamReader()
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(self.reader), self.sandbox.stdout
        )
        self.writer, _ = await loop.connect_write_pipe(asyncio.Protocol, self.sandbox.stdin)

    async def once(self) -> float:
        assert self.reader is not None and self.writer is not None
        started = time.perf_counter()
        self.writer.write(MESSAGE)
        await self.reader.readexactly(len(MESSAGE))
        return time.perf_counter() - started


class Lease(Worker):
    """An already open worker lent to one measurement (opened and closed by the caller)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def once(self) -> float:
        return await self.worker.once()


def lend(workers: list[Worker]) -> Callable[[], Worker]:
    queue = iter(workers)
    return lambda: Lease(next(queue))


def start_echoes(floor: Floor, count: int) -> list[CommandSandbox]:
    """count echo sandboxes, started a few at a time as cloche's pool starts sandboxes."""
    echoes: list[CommandSandbox] = []
    batch = 2 * (os.cpu_count() or 1)
    try:
        for first in range(0, count, batch):
            starting = []
            for _ in range(min(batch, count - first)):
                sandbox = CommandSandbox(
                    floor.backend, [floor.backend.python, "-S", "-c", ECHO_LOOP], floor.limits
                )
                echoes.append(sandbox)
                starting.append(sandbox)
                sandbox.launch()
            for sandbox in starting:
                assert sandbox.stdout is not None
                # Slow when many sandboxes already run: each idle one burns CPU.
                wait_ready(sandbox.stdout, "an echo sandbox", sandbox.startup_log(), 300.0)
    except BaseException:
        for sandbox in echoes:
            sandbox.close(grace_s=5.0)
        raise
    return echoes


async def measure_levels(
    run: Run, name: str, workers: list[Worker], levels: list[int], ops_per_level: int
) -> None:
    for level in levels:
        await measure(name, lend(workers[:level]), total=level * 5, concurrency=level)  # warm
        report = await measure(
            name, lend(workers[:level]), total=max(ops_per_level, 10 * level), concurrency=level
        )
        run.throughput.append({"system": name, "sessions": level, **report.summary()})
        log(
            f"throughput {name} x{level}: {report.throughput:,.0f}/s "
            f"p99 {report.percentile_ms(99):.2f} ms, {report.errors} errors"
        )


def throughput_levels(
    run: Run,
    floor: Floor,
    server: Serve,
    levels: list[int],
    ops_per_level: int,
    floor_max: int | None = None,
) -> None:
    """cells/s and p99 at each level of concurrent sessions: the floor's echo sandboxes
    first (as many as the level, then closed; only up to floor_max), then cloche's sessions
    (as many as the top level, all open at once; idle ones left out of a level are frozen)."""
    top = max(levels)
    for level in levels:
        if floor_max is not None and level > floor_max:
            continue
        # As many echo sandboxes as the level has sessions, and no more: an idle runsc
        # sandbox burns CPU, which would slow the floor down.
        log(f"throughput: starting {level} echo sandboxes")
        echoes = start_echoes(floor, level)
        try:

            async def floor_level(
                echoes: list[CommandSandbox] = echoes, level: int = level
            ) -> None:
                workers: list[Worker] = [EchoWorker(s) for s in echoes]
                for worker in workers:
                    await worker.open()
                await measure_levels(run, "floor", workers, [level], ops_per_level)

            asyncio.run(floor_level())
        finally:
            for sandbox in echoes:
                sandbox.close(grace_s=5.0)

    async def cloche_levels() -> None:
        async with http_client(server.target, top) as http:
            sessions = HTTPSessions(server.target, http)
            workers: list[Worker] = [TCPCell(server.target, sessions) for _ in range(top)]
            log(f"throughput: opening {top} cloche sessions")
            gate = asyncio.Semaphore(2 * (os.cpu_count() or 1))

            async def open_one(worker: Worker) -> None:
                async with gate:
                    await worker.open()

            try:
                await asyncio.gather(*(open_one(w) for w in workers))
                await asyncio.to_thread(server.wait_pooled, "lean", POOL)  # a quiet machine
                await asyncio.to_thread(server.wait_pooled, "data", DATA_POOL)
                await measure_levels(run, "cloche", workers, levels, ops_per_level)
                # While the sessions sit idle: what gVisor burns for nothing.
                await asyncio.sleep(2.0)
                run.memory["idle_cpu_sessions"] = top
                run.memory["idle_cpu_per_session_pct"] = (
                    await asyncio.to_thread(server.sandbox_cpu_pct, 10.0)
                ) / (top + POOL + DATA_POOL)
                log(
                    f"idle CPU per sandbox: {run.memory['idle_cpu_per_session_pct']:.2f}% of a core"
                )
            finally:
                await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)

    asyncio.run(cloche_levels())
