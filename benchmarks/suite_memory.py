"""The suite's memory: per idle session of a profile (PSS, cgroup, MemAvailable), the same
preload outside any sandbox, and whether many idle sessions leave the server answering.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from cloche.bench import HTTPSessions, TCPCell, http_client, measure
from cloche.sessions.profiles import PROFILES
from floor import wait_ready
from serving import Serve, mem_available_kib, pss_of
from suite_run import DATA_POOL, POOL, Run

RUNTIME = Path(sys.prefix).parent / ".runtime" / "site-packages"


def memory_per_session(run: Run, server: Serve, profile: str, count: int) -> None:
    """PSS and MemAvailable per idle session of a profile, from `count` new sessions."""

    async def go() -> None:
        async with http_client(server.target, 4) as http:
            sessions = HTTPSessions(server.target, http)
            await asyncio.to_thread(server.wait_pooled, "lean", POOL)
            await asyncio.to_thread(server.wait_pooled, "data", DATA_POOL)
            await asyncio.sleep(1.0)
            before_pss = server.sandbox_pss_kib()[1]
            before_cgroup = server.sandbox_cgroup_mib()
            before_available = mem_available_kib()
            ids = []
            try:
                for _ in range(count):
                    ids.append(await sessions.create(profile))
                    await sessions.execute(ids[-1], "1+1")
                await asyncio.to_thread(server.wait_pooled, "lean", POOL)
                await asyncio.to_thread(server.wait_pooled, "data", DATA_POOL)
                await asyncio.sleep(2.0)
                after_pss = server.sandbox_pss_kib()[1]
                after_cgroup = server.sandbox_cgroup_mib()
                after_available = mem_available_kib()
            finally:
                for session_id in ids:
                    await sessions.delete(session_id)
        run.memory[f"{profile}_pss_per_session_mib"] = (after_pss - before_pss) / count / 1024
        run.memory[f"{profile}_cgroup_per_session_mib"] = (after_cgroup - before_cgroup) / count
        run.memory[f"{profile}_available_drop_per_session_mib"] = (
            (before_available - after_available) / count / 1024
        )

    asyncio.run(go())


def outside_memory(profile: str) -> float:
    """PSS (MiB) of a plain python3 that did what a profile preloads, outside any sandbox."""
    code = (
        PROFILES[profile].preload
        + "\nimport sys\nsys.stdout.write('R')\nsys.stdout.flush()\nsys.stdin.read()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(RUNTIME), "MPLBACKEND": "Agg"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            f"import sys; sys.path.append({str(RUNTIME)!r})\n" + code,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None
        wait_ready(process.stdout, f"python3 with the {profile} preload")
        return pss_of([process.pid])[1] / 1024
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(30)


def idle_sessions_fit(run: Run, server: Serve, count: int) -> None:
    """Hold `count` idle lean sessions; then check the server still answers promptly."""

    async def go() -> None:
        async with http_client(server.target, 16) as http:
            sessions = HTTPSessions(server.target, http)
            before = mem_available_kib()
            ids: list[str] = []
            gate = asyncio.Semaphore(2 * (os.cpu_count() or 1))

            async def one() -> None:
                async with gate:
                    ids.append(await sessions.create("lean"))

            series: list[dict[str, float]] = []
            base_pss = server.sandbox_pss_kib()[1]

            async def watch() -> None:
                while True:
                    pss = await asyncio.to_thread(server.sandbox_pss_kib)
                    series.append(
                        {
                            "sessions": len(ids),
                            "pss_mib": (pss[1] - base_pss) / 1024,
                            "available_drop_mib": (before - mem_available_kib()) / 1024,
                        }
                    )
                    await asyncio.sleep(2.0)

            watcher = asyncio.create_task(watch())
            started = time.perf_counter()
            results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
            watcher.cancel()
            await asyncio.sleep(2.0)
            pss_now = server.sandbox_pss_kib()[1]
            series.append(
                {
                    "sessions": len(ids),
                    "pss_mib": (pss_now - base_pss) / 1024,
                    "available_drop_mib": (before - mem_available_kib()) / 1024,
                }
            )
            run.memory["series"] = series
            failures = [r for r in results if isinstance(r, BaseException)]
            run.memory["idle_wanted"] = count
            run.memory["idle_created"] = len(ids)
            run.memory["idle_create_failures"] = len(failures)
            run.memory["idle_create_s"] = time.perf_counter() - started
            run.memory["idle_available_drop_gib"] = (before - mem_available_kib()) / 1024 / 1024
            try:
                probe = await measure(
                    "probe", lambda: TCPCell(server.target, sessions), total=200, concurrency=1
                )
                run.memory["idle_probe_p50_ms"] = probe.percentile_ms(50)
                run.memory["idle_probe_errors"] = probe.errors
                health = await http.get("/health")
                run.memory["idle_health"] = health.status_code
            finally:
                gate2 = asyncio.Semaphore(16)

                async def close(session_id: str) -> None:
                    async with gate2:
                        await sessions.delete(session_id)

                await asyncio.gather(*(close(i) for i in ids), return_exceptions=True)

    asyncio.run(go())
