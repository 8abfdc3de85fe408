"""Packages: `%pip install` in a session (cold and from the wheel cache), a profile's build,
and the first session of a new profile.

    .venv/bin/python benchmarks/bench_packages.py [--samples N] [--markdown FILE]

Run as root with runsc on PATH and the package index reachable (pip's configuration).
Each figure is wall time as a client sees it, on this machine, with the real index:

1. `%pip install -q humanize` then `import humanize` in one cell of a fresh session: with an
   empty wheel cache (resolve + download + unpack), and with the wheel already cached
   (resolve + unpack; pip still asks the index which version is newest).
2. A profile's runtime built from `["tabulate", "six", "humanize"]` with an empty cache,
   and found again by a restarted server (no index needed).
3. The first session of a new profile: from the server's start (with the profile file) to
   the answer of the session's first cell, the session asked for as soon as the profile
   is listed ready.

Everything it starts is stopped and its temporary directory removed.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cloche
from bench_core import DEFAULT_RUNTIME_DIR, ServerThread
from cloche.config import Limits, PackageConfig, ServerConfig
from cloche.packages.cache import WheelCache
from cloche.packages.profiles import ProfileSpec, RuntimeBuilder
from cloche.packages.resolver import Pip

PROFILE = (
    '[profiles.bench]\nrequirements = ["tabulate", "six", "humanize"]\n'
    'preload = ["tabulate"]\npool = 1\n'
)


def url(server: ServerThread) -> str:
    http = server.server.http
    assert http is not None
    return f"http://127.0.0.1:{http.port}"


def config(base: Path, cache: Path, **extra: object) -> ServerConfig:
    return ServerConfig(
        tcp_port=0,
        http_port=0,
        backend="gvisor",
        pool_size=1,
        data_pool_size=0,
        state_dir=base / "state",
        runtime_dir=DEFAULT_RUNTIME_DIR if DEFAULT_RUNTIME_DIR.is_dir() else None,
        limits=Limits(cell_timeout_s=120.0),
        packages=PackageConfig(cache_dir=cache),
        **extra,  # type: ignore[arg-type]
    )


def pip_install(base: Path, samples: int) -> dict[str, list[float]]:
    """Seconds of a `%pip install` cell, each in a fresh session: with an empty cache; with
    the wheel cached and the resolution reused (the same server, minutes later); with the
    wheel cached but resolved again (a restarted server)."""
    found: dict[str, list[float]] = {"cold": [], "reused": [], "resolved": []}
    for sample in range(samples):
        cache = base / f"cache-{sample}"
        for kinds in (("cold", "reused"), ("resolved",)):
            with ServerThread(config(base, cache)) as server:
                with cloche.Client(url(server)) as client:
                    for kind in kinds:
                        server.call(server.server.manager.pool.wait_full())
                        with client.create_session() as session:
                            started = time.perf_counter()
                            execution = session.run("%pip install -q humanize\nimport humanize")
                            found[kind].append(time.perf_counter() - started)
                            assert execution.error is None, execution.error
        shutil.rmtree(cache)
    return found


def profile_build(base: Path, samples: int) -> tuple[list[float], list[float]]:
    """(built with an empty cache, found again) seconds of a profile's runtime."""
    spec = ProfileSpec("bench", ("tabulate", "six", "humanize"))
    built: list[float] = []
    found: list[float] = []
    for sample in range(samples):
        cache = WheelCache(base / f"profile-cache-{sample}")
        cache.prepare()
        pip = Pip(sys.executable, None, cache.root / "tool", None, 300.0)
        pip.prepare()
        builder = RuntimeBuilder(pip, cache, cache.root / "runtimes")
        for into in (built, found):
            started = time.perf_counter()
            asyncio.run(builder.build(spec))
            into.append(time.perf_counter() - started)
        shutil.rmtree(cache.root)
    return built, found


def first_session(base: Path, samples: int) -> list[float]:
    """Seconds from a server's start to the first cell of a session of its new profile."""
    profiles = base / "profiles.toml"
    profiles.write_text(PROFILE)
    result: list[float] = []
    for sample in range(samples):
        cache = base / f"first-cache-{sample}"
        started = time.perf_counter()
        with ServerThread(config(base, cache, profiles_file=profiles)) as server:
            catalog = server.server.manager.catalog
            assert catalog is not None
            status = server.call(catalog.wait("bench", 300))
            assert status is not None and status.state.value == "ready", status
            with cloche.Client(url(server)) as client:
                with client.create_session("bench") as session:
                    execution = session.run("import tabulate")
                    result.append(time.perf_counter() - started)
                    assert execution.error is None, execution.error
        shutil.rmtree(cache)
    return result


def row(what: str, values: list[float]) -> str:
    median = statistics.median(values)
    return f"| {what} | {len(values)} | {median:.2f} | {min(values):.2f} | {max(values):.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="cloche-bench-packages-"))
    try:
        installs = pip_install(base, args.samples)
        built, found = profile_build(base, args.samples)
        first = first_session(base, args.samples)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    table = "\n".join(
        [
            "| what | n | median s | min s | max s |",
            "|---|---|---|---|---|",
            row("`%pip install humanize` + import, empty wheel cache", installs["cold"]),
            row("... wheel cached, resolution reused (same server)", installs["reused"]),
            row("... wheel cached, resolved again (restarted server)", installs["resolved"]),
            row("profile runtime built (tabulate, six, humanize), empty cache", built),
            row("profile runtime found again (restart)", found),
            row("server start -> first cell of a session of the new profile", first),
        ]
    )
    print(table)
    if args.markdown is not None:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
