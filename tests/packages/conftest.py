"""Servers for the package tests: real gVisor, wheels from the real package index."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import cloche
from cloche.config import Limits, PackageConfig
from support import ServerThread, make_config, require_gvisor

# The SDK waits for a cell's answer its time limit plus 30 s, and an install holds the
# cell's clock: on a loaded machine, pip's runs against the real index take a while.
LIMITS = Limits(cell_timeout_s=120.0, interrupt_grace_s=1.0)


@pytest.fixture(scope="module")
def package_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wheel-cache")


@pytest.fixture(scope="module")
def pkg_server(state_root: Path, package_cache: Path) -> Iterator[ServerThread]:
    """A server whose sessions install from the index through a cache of this module's."""
    require_gvisor()
    config = make_config(
        state_root, pool_size=2, limits=LIMITS, packages=PackageConfig(cache_dir=package_cache)
    )
    with ServerThread(config) as running:
        yield running


@pytest.fixture
def session(pkg_server: ServerThread) -> Iterator[cloche.Session]:
    with cloche.Client(f"http://127.0.0.1:{pkg_server.http_port}") as client:
        with client.create_session() as opened:
            yield opened


@pytest.fixture
def packages_server(state_root: Path, package_cache: Path) -> Iterator[Callable[..., ServerThread]]:
    """Start a server with its own package settings: packages_server(max_mib=1, ...)."""
    require_gvisor()
    started: list[ServerThread] = []

    def make(**settings: object) -> ServerThread:
        packages = PackageConfig(cache_dir=package_cache, **settings)  # type: ignore[arg-type]
        config = make_config(state_root, pool_size=1, limits=LIMITS, packages=packages)
        running = ServerThread(config).__enter__()
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()


def sandbox_of(server: ServerThread, session_id: str):  # type: ignore[no-untyped-def]
    return server.server.manager._sessions[session_id].kernel.sandbox  # type: ignore[attr-defined]
