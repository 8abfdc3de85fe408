"""The backend interface, modelled on `subprocess.Popen` (the named registry of backends is
`registry.py`).

A `Backend` is prepared once per server (checks, state directory, leftovers of a crashed
run) and makes `Sandbox`es. A `Sandbox` is one started kernel: launch it, talk to it over
its stdin/stdout pipes, interrupt it, kill it, clean up after it.
"""

from __future__ import annotations

import abc
import enum
import logging
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, ClassVar

from cloche.config import Limits, ServerConfig
from cloche.sandbox.bundle import VolumeBind
from cloche.sandbox.layers import System
from cloche.sandbox.state import StateDir

log = logging.getLogger("cloche.sandbox")

KERNEL_PACKAGE_DIR = Path(__file__).resolve().parent.parent / "kernel"

# Imports cloche.kernel without cloche/__init__.py (which needs the host's packages): the
# sandbox sees only the kernel's directory. argv: [-c, dir holding cloche/, sys.path...]
_BOOTSTRAP = (
    "import sys,types;"
    "m=types.ModuleType('cloche');m.__path__=[sys.argv[1]+'/cloche'];sys.modules['cloche']=m;"
    "sys.path[:0]=sys.argv[2:];"
    "from cloche.kernel.main import main;main()"
)
# How the report of a Go runtime's crash (gVisor's) begins, at the start of a line.
CRASH_STARTS = ("panic: ", "fatal error: ")


# Done to a new sandbox before it launches, by the layers above (its volumes bound).
SandboxSetup = Callable[["Sandbox"], Awaitable[None]]


def kernel_command(python: str, package_parent: str, sys_path: list[str]) -> list[str]:
    """The command line that starts a kernel."""
    return [python, "-I", "-S", "-B", "-c", _BOOTSTRAP, package_parent, *sys_path]


class ExitStep(enum.Enum):
    """Which step of the shutdown ladder ended a sandbox."""

    EXITED = "exited"  # it was already gone (crashed, or killed from inside)
    CLOSED = "closed"  # its channel was closed and the kernel exited on its own
    KILLED = "killed"  # it had to be killed
    FORCED = "forced"  # even the kill didn't end it; its supervisor was killed


class Sandbox(abc.ABC):
    """One kernel in isolation. Not yet running until `launch()`."""

    def __init__(self, sandbox_id: str, workdir: Path, limits: Limits) -> None:
        self.id = sandbox_id
        self.workdir = workdir  # host path of the session's working directory
        # Host path of the session's writable site directory (packages installed into the
        # session), on its kernel's sys.path; None when the backend has none.
        self.site_dir: Path | None = None
        self.file_owner: tuple[int, int] | None = None  # (uid, gid) for files we put there
        # The user the session's cells run as, by name, which its commands run as unless
        # they ask for root; None: the kernel's own (a backend without users).
        self.user: str | None = None
        self.root_inside = False  # a command may run as root inside
        # The host directory where the session's doors (unix sockets: ports', and egress's
        # with a policy) go, and its path as the kernel sees it; None: no doors.
        self.door_dir: Path | None = None
        self.door_inside: str | None = None
        self.limits = limits
        self.process: subprocess.Popen[bytes] | None = None
        self.exit_step: ExitStep | None = None
        self._cleaned = False
        self.urgent = False  # a session waits for this start: no lowered CPU weight
        # Its checkpoint is restored many times (a pool's template): it starts as the
        # backend starts sandboxes on a quiet host, whatever the load now.
        self.for_clones = False
        # A checkpoint image to restore instead of starting the kernel afresh (see
        # `checkpoint`): the kernel comes back as it was saved, without a `ready` message.
        self.restore_from: Path | None = None
        # With restore_from: the saved disk (see `disk`, `archive.pack`), laid out again before
        # the kernel comes back, so the files it had open are found where they were.
        self.seed: Path | None = None
        # Volumes bound into it (before `launch`), and what to call once it is freed (their
        # leases let go).
        self.volumes: list[VolumeBind] = []
        self.when_freed: list[Callable[[], None]] = []

    @property
    def disk(self) -> Path:
        """The host directory holding what the session writes (its working directory, and
        its site directory where the backend has one): what a checkpoint saves beside its
        image, and `seed` lays out again."""
        return self.workdir

    def use_runtime(self, runtime_dir: Path) -> None:
        """Give the kernel this site-packages as its runtime instead of the server's
        (--runtime-dir): a profile's own. Before `launch`."""
        raise NotImplementedError(f"the {type(self).__name__} backend has one runtime only")

    @abc.abstractmethod
    def launch(self) -> None:
        """Start the kernel (blocking; call from a thread)."""

    def started(self) -> None:  # noqa: B027  # optional hook
        """Called once the kernel said it is ready (blocking; call from a thread)."""

    def serving(self) -> None:  # noqa: B027  # optional hook
        """Called when a session takes the sandbox: from now on its cells are waited for."""

    def background(self, behind: bool, *, busy: bool = False) -> None:  # noqa: B027
        """Put the sandbox behind the others for CPU (its cell has run long) or back level
        with them. busy (with behind): it is using the CPU too, so put it behind the host's
        own processes as well, where the backend can. An optional hook."""

    @property
    def behind_the_host(self) -> bool:
        """Whether `background(True, busy=True)` put it behind the host's processes (until
        `level_with_the_host` or `background(False)`)."""
        return False

    def level_with_the_host(self) -> None:  # noqa: B027  # optional hook
        """Undo the `busy` part of `background` (its weight among the sandboxes stays): a
        cell being interrupted needs the CPU to stop within the grace."""

    def freeze(self) -> bool:
        """Stop every process of the sandbox until `thaw` (an idle one costs no CPU then);
        False when this backend can't."""
        return False

    def thaw(self) -> None:  # noqa: B027  # optional hook
        """Let a frozen sandbox run again. Cheap when it isn't frozen."""

    def checkpoint(
        self, image: Path, *, leave_running: bool = False, compressed: bool = True
    ) -> str | None:
        """Save the running sandbox into the directory image, for `restore_from`; this
        stops it unless leave_running. None when saved, else why not (a backend that can't
        says so). An uncompressed image is larger and restores faster. The working
        directory is not in the image: save it with `archive.pack`."""
        return f"the {type(self).__name__} backend can't checkpoint"

    def cpu_seconds(self) -> float | None:
        """CPU time the sandbox has used so far; None when the backend can't tell."""
        return None

    def memory_bytes(self) -> int | None:
        """Memory the sandbox holds now; None when the backend can't tell."""
        return None

    def runtime_log(self) -> str:
        """What the sandbox's runtime wrote about itself (from `CRASH_STARTS` on when it
        crashed, else its last lines); empty when the backend keeps none (blocking)."""
        return ""

    def oom_killed(self) -> bool:
        """Whether the memory cgroup's OOM killer has killed a process of the sandbox (read
        before it is removed); False when the backend can't tell (blocking)."""
        return False

    def peers_cpu_seconds(self) -> float | None:
        """CPU time the sandboxes of this server have used so far while level with the host
        (not behind it); None when the backend can't tell."""
        return None

    @property
    def stdin(self) -> IO[bytes]:
        assert self.process is not None and self.process.stdin is not None
        return self.process.stdin

    @property
    def stdout(self) -> IO[bytes]:
        assert self.process is not None and self.process.stdout is not None
        return self.process.stdout

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def poll(self) -> int | None:
        return self.process.poll() if self.process else None

    def wait(self, timeout_s: float | None = None) -> int:
        assert self.process is not None
        return self.process.wait(timeout_s)

    @abc.abstractmethod
    def interrupt(self) -> None:
        """Raise KeyboardInterrupt in the kernel (SIGINT to the sandboxed interpreter)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """End the kernel now."""

    def close(self, grace_s: float = 2.0) -> ExitStep:
        """End the sandbox by the ladder: close its channel, kill it, kill its supervisor.

        Blocking and idempotent; returns the step that ended it and frees everything.
        """
        if self.exit_step is None and self.process is not None:
            self.exit_step = self._shutdown(self.process, grace_s)
        self.cleanup()
        return self.exit_step or ExitStep.EXITED

    def _shutdown(self, process: subprocess.Popen[bytes], grace_s: float) -> ExitStep:
        if process.poll() is not None:
            return ExitStep.EXITED
        for stream in (process.stdin,):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            process.wait(grace_s)
            return ExitStep.CLOSED
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        try:
            process.wait(grace_s)
            return ExitStep.KILLED
        except subprocess.TimeoutExpired:
            pass
        process.kill()
        process.wait()
        return ExitStep.FORCED

    def cleanup(self) -> None:
        """Free what the sandbox held on the host. Idempotent."""
        if self._cleaned:
            return
        self._cleaned = True
        if self.process is not None:
            for stream in (self.process.stdin, self.process.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass
        try:
            self._release()
        finally:
            for freed in self.when_freed:
                try:
                    freed()
                except Exception:  # one hook's failure must not keep the others from running
                    log.exception("sandbox %s: a hook after its release failed", self.id)

    @abc.abstractmethod
    def _release(self) -> None:
        """Backend-specific part of cleanup, after the process is gone."""


class Backend(abc.ABC):
    """Makes sandboxes of one kind. One per server."""

    name: ClassVar[str]
    unsafe: ClassVar[bool] = False
    can_checkpoint: ClassVar[bool] = False  # its sandboxes can be saved and restored
    can_mount_volumes: ClassVar[bool] = False  # its sandboxes take `Sandbox.volumes`

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state = StateDir(config.state_dir)

    def prepare(self) -> None:
        """Check the machine, clean a crashed run's leftovers, claim a state directory."""
        self.state.claim(self.clean_stale)

    def sweep(self) -> None:
        """Clean what stopped or crashed servers left under --state-dir, claiming nothing."""
        self.state.sweep(self.clean_stale)

    @abc.abstractmethod
    def clean_stale(self, instance_dir: Path) -> None:
        """Remove what a previous (crashed) server left in instance_dir."""

    @abc.abstractmethod
    def create(self, limits: Limits, system: System | None = None) -> Sandbox:
        """A new sandbox (not launched yet), of system (by default the template python)."""

    def shutdown(self) -> None:
        """Release the state directory. Sandboxes must be closed before."""
        self.state.release()

    def reserved_paths(self) -> list[str]:
        """Directories its sandboxes mount for themselves: no volume goes at, in or above
        one of them."""
        return []

    def image_origin(self) -> str:
        """What a checkpoint image made here depends on: another is not restored."""
        return f"{self.name} python {sys.version.split()[0]}"

    def new_id(self) -> str:
        return secrets.token_hex(8)

    def describe(self) -> str:
        return self.name


def interrupt_pid(pid: int | None) -> None:
    """Send SIGINT to pid, ignoring a process that is already gone."""
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        pass
