"""Shared fixtures: real servers (gVisor backend) run in a background thread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cloche.client.tcp import TCPClient
from dockerd import Daemon
from images_support import make_debian_tar
from support import ServerThread, make_config, require_gvisor


@pytest.fixture(scope="session")
def state_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="module")
def server(state_root: Path) -> Iterator[ServerThread]:
    """One gVisor server shared by a test module."""
    require_gvisor()
    with ServerThread(make_config(state_root)) as running:
        yield running


@pytest.fixture
def make_server(state_root: Path) -> Iterator[object]:
    """Start extra servers with their own settings: make_server(pool_size=0, ...)."""
    require_gvisor()
    started: list[ServerThread] = []

    def make(**overrides: object) -> ServerThread:
        running = ServerThread(make_config(state_root, **overrides)).__enter__()
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()


@pytest.fixture
def client(server: ServerThread) -> Iterator[TCPClient]:
    with server.client() as connection:
        yield connection


@pytest.fixture(scope="session")
def docker_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A Docker engine for the run: the one that answers, or dockerd started (and stopped)."""
    daemon = Daemon(tmp_path_factory.mktemp("dockerd") / "dockerd.log")
    daemon.ensure()
    yield
    daemon.stop()


@pytest.fixture(scope="session")
def debian_tar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A Debian bookworm minbase root tarball with python3 and python3-yaml, made by
    mmdebstrap once per run (and removed at its end)."""
    path = tmp_path_factory.mktemp("debian") / "bookworm.tar"
    yield make_debian_tar(path)
    path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def debian_tar_without_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A Debian bookworm minbase root tarball without python3, with a setuid-root copy of
    `id` (images_support.SETUID_ID), made by mmdebstrap once per run (removed at its end)."""
    path = tmp_path_factory.mktemp("debian-without-python") / "bookworm.tar"
    yield make_debian_tar(path, python=False)
    path.unlink(missing_ok=True)
