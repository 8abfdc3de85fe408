"""Typed, frozen configuration. Units are in the names; defaults are the secure ones."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """What one session may use. See the limits table in the execution spec."""

    cell_timeout_s: float = 30.0
    interrupt_grace_s: float = 2.0
    memory_mib: int = 1024  # RLIMIT_AS of the sandboxed interpreter
    nproc: int = 64  # RLIMIT_NPROC inside the sandbox
    disk_mib: int = 256  # working directory, and /tmp, each
    output_bytes: int = 1 * MIB  # stdout + stderr kept per cell
    nofile: int = 1024  # RLIMIT_NOFILE
    idle_timeout_s: float = 30 * 60.0
    lifetime_s: float = 24 * 3600.0
    pids_cgroup: int = 512  # host-side backstop; gVisor's own threads count too
    cpu_quota: float | None = None  # cores; None = unlimited

    @property
    def cgroup_memory_mib(self) -> int:
        """The host cgroup backstop: the rlimit, plus /tmp (held in the sentry), plus slack."""
        return self.memory_mib + self.disk_mib + 128


def default_state_dir() -> Path:
    """Where per-server state lives: /run/cloche as root, else a private tmp dir."""
    if os.geteuid() == 0:
        return Path("/run/cloche")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "cloche" if runtime else Path(f"/tmp/cloche-{os.geteuid()}")  # noqa: S108


@dataclass(frozen=True)
class ServerConfig:
    """Everything `cloche serve` is told."""

    host: str = "127.0.0.1"
    tcp_port: int = 8000
    http_port: int = 8080
    backend: str = "auto"
    pool_size: int = 2  # ready `lean` sandboxes
    data_pool_size: int = 1  # ready `data` sandboxes (the data stack imported)
    max_sessions: int = 100
    max_queued_cells: int = 16  # per session, beyond the running one
    max_frame_bytes: int = 16 * MIB
    max_connections: int = 1024
    connection_idle_timeout_s: float = 300.0
    limits: Limits = field(default_factory=Limits)
    state_dir: Path = field(default_factory=default_state_dir)
    runtime_dir: Path | None = None  # site-packages for code inside the sandbox
    tokens: frozenset[str] = frozenset()
    platform: str = "auto"  # runsc platform: auto, systrap, ptrace
    start_concurrency: int = 0  # sandboxes started at once by the pool; 0 = number of cores
