"""The unsafe_local backend: the same kernel as a plain subprocess. NOT a sandbox.

For machines without runsc (development, CI of other projects). Code it runs can read
and write whatever the server's user can. Opt-in only, and loud about it at every start.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from cloche.config import MIB, Limits, ServerConfig
from cloche.errors import SandboxStartError
from cloche.sandbox.base import (
    KERNEL_PACKAGE_DIR,
    Backend,
    Sandbox,
    interrupt_pid,
    kernel_command,
    log,
)
from cloche.sandbox.layers import System

WARNING = (
    "backend unsafe-local: code runs as a plain subprocess with the server's own rights, "
    "NOT isolated. Never use it for untrusted code; install runsc and use --backend gvisor."
)


class UnsafeLocalBackend(Backend):
    """A subprocess per session, with rlimits and nothing else."""

    name = "unsafe-local"
    unsafe = True

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(config)
        self.sys_path: list[str] = []
        if config.runtime_dir is not None and config.runtime_dir.is_dir():
            self.sys_path.append(str(config.runtime_dir.resolve()))

    def prepare(self) -> None:
        log.warning(WARNING)
        super().prepare()
        (self.state.path / "sandboxes").mkdir()

    def clean_stale(self, instance_dir: Path) -> None:
        """Nothing beyond the directory itself: its kernels exit when their pipes close."""

    def create(self, limits: Limits, system: System | None = None) -> UnsafeLocalSandbox:
        if system is not None and system.name != "python":
            raise SandboxStartError(f"the {self.name} backend has no templates but python")
        return UnsafeLocalSandbox(self, self.new_id(), limits)


class UnsafeLocalSandbox(Sandbox):
    def __init__(self, backend: UnsafeLocalBackend, sandbox_id: str, limits: Limits) -> None:
        self.backend = backend
        self.home = backend.state.path / "sandboxes" / sandbox_id
        super().__init__(sandbox_id, self.home / "work", limits)
        self.site_dir: Path = self.home / "site"  # not counted against a disk limit: no tmpfs here
        self.sys_path = backend.sys_path

    def use_runtime(self, runtime_dir: Path) -> None:
        self.sys_path = [str(runtime_dir.resolve())]

    def launch(self) -> None:
        limits = self.limits

        def set_limits() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mib * MIB,) * 2)
            resource.setrlimit(resource.RLIMIT_NOFILE, (limits.nofile,) * 2)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        try:
            self.workdir.mkdir(parents=True)
            self.site_dir.mkdir()
            self.door_dir = self.home / "door"  # the doors (ports, egress), at their host path
            self.door_dir.mkdir()
            self.door_inside = str(self.door_dir)
            self.process = subprocess.Popen(
                kernel_command(
                    sys.executable,
                    str(KERNEL_PACKAGE_DIR.parent.parent),
                    [*self.sys_path, str(self.site_dir)],
                ),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=self.workdir,
                env={
                    "PATH": os.defpath,
                    "HOME": str(self.workdir),
                    "LANG": "C.UTF-8",
                    "MPLBACKEND": "Agg",
                    "MALLOC_ARENA_MAX": "2",
                    "TMPDIR": str(self.workdir),
                },
                preexec_fn=set_limits,  # noqa: PLW1509
                start_new_session=True,
                bufsize=0,
            )
        except Exception as exc:
            self.cleanup()
            raise SandboxStartError(f"could not start kernel {self.id}: {exc}") from exc

    def interrupt(self) -> None:
        interrupt_pid(self.pid)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)

    def _release(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill()
            self.process.wait()
        shutil.rmtree(self.home, ignore_errors=True)
