"""The gVisor backend: every sandbox is a `runsc run` of a hand-made OCI bundle."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cloche.config import Limits, ServerConfig
from cloche.errors import BackendUnavailable, SandboxStartError
from cloche.sandbox import archive, cgroups, layers, mounts
from cloche.sandbox.base import (
    Backend,
    ExitStep,
    Sandbox,
    interrupt_pid,
    log,
)
from cloche.sandbox.bundle import (
    DOOR_MOUNT,
    Mount,
    build_rootfs,
    oci_config,
)
from cloche.sandbox.interpreter import Interpreters
from cloche.sandbox.layers import System
from cloche.sandbox.runsc import INSTALL_HINT, MADE_ON, Runsc, last_words, made_on

PLATFORMS = ("systrap", "ptrace")  # KVM hangs under nested virtualisation: not tried
# With platform "auto", sandboxes started while this many per core already run use ptrace
# instead of systrap: systrap's sentry spins ~20 µs on each side of a syscall hand-off
# before sleeping, and with more runnable sandboxes than cores that spinning takes the CPU
# the others need (sentry CPU per cell, 2 cores: 0.2 ms at 1 busy session, 1 ms at 10,
# 8.5 ms at 50 under systrap; see benchmarks/results/throughput.md).
PTRACE_FROM_PER_CORE = 2
STALE_CGROUP_WAIT_S = 10.0  # a dead server's sandboxes, killed, to leave their cgroups
# A probe sandbox's kernel has this share of --sandbox-start-timeout to say it is up (30 s
# of 60): a platform that hangs costs the server's start-up less.
PROBE_SHARE = 0.5
# What a session's saved disk holds (see `layers`), and its mounts (3: every sandbox has
# its door directory, for ports): an image of another layout is refused.
LAYOUT_VERSION = 3


class GVisorBackend(Backend):
    """One runsc sandbox per session."""

    name = "gvisor"
    can_checkpoint = True
    can_mount_volumes = True

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(config)
        self.runsc: Runsc | None = None
        self.cgroups = True  # whether sandboxes get cgroups (found out by prepare)
        # Whether sandboxes running long move to the top-level behind group (prepare finds
        # out); moves run in one thread, in the order asked, as one can take tens of ms.
        self.moves_behind = False
        self.cpu_mover = ThreadPoolExecutor(1, thread_name_prefix="cloche-cpu-group")
        self.interpreters = Interpreters(config.runtime_dir)
        self._ptrace_when_busy = False  # platform "auto" chose systrap (see platform_for_new)
        self._ptrace_works = False  # what the probe at start-up found
        self._ptrace_probed = threading.Event()
        self._ptrace_probe: threading.Thread | None = None
        self._live = 0  # sandboxes launched and not yet released
        self._live_lock = threading.Lock()  # launches and releases run in threads

    @property
    def rootfs(self) -> Path:
        return self.state.path / "rootfs"

    @property
    def system(self) -> System:
        """The built-in template `python`: the skeleton root over the host's /usr."""
        return System(name="python", rootfs=self.rootfs, usr=Path("/usr"), shell_path="/bin/bash")

    def prepare(self) -> None:
        if os.geteuid() != 0:
            raise BackendUnavailable(
                "the gVisor backend needs root (runsc creates namespaces and cgroups): run "
                "cloche serve as root, or use --backend unsafe-local, which is NOT isolated"
            )
        self.runsc = Runsc.find(self.config.state_dir / "runsc")
        where = cgroups.prepare()
        self.cgroups = not where.startswith("not writable")
        if not self.cgroups:
            log.warning(
                "no writable cgroups (%s): sandboxes run without them, so these limits are "
                "NOT enforced: %s. See the README's Privileges and Hosts",
                where.removeprefix("not writable: "),
                "; ".join(cgroups.CGROUP_ONLY_LIMITS),
            )
        else:
            log.info("sandbox cgroups: %s", where)
        self.runsc.ignore_cgroups = not self.cgroups
        # Every sandbox has its doors: ports always, egress with --egress-policy.
        self.runsc.host_uds = True
        self.moves_behind = self.cgroups and cgroups.can_move_behind()
        super().prepare()
        # Empty cgroups of servers that died with their state elsewhere (rmdir can only
        # remove empty ones: live sandboxes keep theirs).
        for top in cgroups.tops():
            cgroups.remove(top)
        self.runsc.root = self.state.path / "runsc"
        self.runsc.root.mkdir(mode=0o700)
        (self.state.path / "sandboxes").mkdir()
        self.views = mounts.ReadOnlyViews(self.state.path / "ro")
        build_rootfs(self.rootfs, self.interpreters.mounts)
        self.runsc.platform = self._choose_platform()
        self._ptrace_when_busy = self.config.platform == "auto" and self.runsc.platform == "systrap"
        if self._ptrace_when_busy:
            # Probed now, while the machine is quiet, and in the background, so that the
            # server is up at once. Probed on the first busy start instead, the probe would
            # run beside a burst of starts and time out, and every start of the burst
            # would go on systrap meanwhile.
            self._ptrace_probe = threading.Thread(
                target=self._probe_ptrace, name="cloche-ptrace-probe", daemon=True
            )
            self._ptrace_probe.start()
        log.info(
            "gVisor backend ready: runsc %s, platform %s, state %s",
            self.runsc.version,
            self.runsc.platform,
            self.state.path,
        )

    def _choose_platform(self) -> str:
        assert self.runsc is not None
        wanted = self.config.platform
        candidates = PLATFORMS if wanted == "auto" else (wanted,)
        failures: list[str] = []
        for platform in candidates:
            self.runsc.platform = platform
            error = self._probe()
            if error is None:
                return platform
            failures.append(f"{platform}: {error}")
        raise BackendUnavailable(
            f"runsc {self.runsc.version} could not start a sandbox ({'; '.join(failures)}): "
            + INSTALL_HINT
        )

    def _probe(self, platform: str | None = None) -> str | None:
        """Start a sandbox (on platform, else runsc's) and wait for its kernel's first
        message; the error, if any."""
        sandbox = self.create(Limits())
        sandbox.platform = platform
        try:
            sandbox.launch()
            ready, _, _ = select.select([sandbox.stdout], [], [], self._probe_timeout_s)
            if not ready or not sandbox.stdout.read(4):
                return sandbox.runtime_log() or (
                    f"no answer from the kernel within {self._probe_timeout_s:g} s "
                    "(half of --sandbox-start-timeout)"
                )
            return None
        except Exception as exc:  # any failure means this platform is not usable
            return str(exc)
        finally:
            sandbox.close(grace_s=5.0)

    @property
    def _probe_timeout_s(self) -> float:
        return self.config.sandbox_start_timeout_s * PROBE_SHARE

    def reserved_paths(self) -> list[str]:
        return self.interpreters.reserved_paths()

    def image_origin(self) -> str:
        assert self.runsc is not None
        runtime = ""
        if self.config.runtime_dir is not None and self.config.runtime_dir.is_dir():
            stat = self.config.runtime_dir.stat()
            runtime = f" runtime {self.config.runtime_dir.resolve()}@{stat.st_mtime_ns}"
        version = f"runsc {self.runsc.version} {self.runsc.platform} layout {LAYOUT_VERSION}"
        return f"{super().image_origin()} {version}{runtime}"

    def count_live(self, change: int) -> int:
        """Count sandboxes launched (1) or released (-1); the number live now."""
        with self._live_lock:
            self._live += change
            return self._live

    def _probe_ptrace(self) -> None:
        try:
            error = self._probe("ptrace")
        except Exception as exc:  # whatever it was, ptrace is not used
            error = str(exc)
        self._ptrace_works = error is None
        self._ptrace_probed.set()
        log.info(
            "sandboxes started beyond %d at once use ptrace: %s",
            PTRACE_FROM_PER_CORE * (os.cpu_count() or 1),
            "yes" if error is None else f"no, it failed ({error})",
        )

    def platform_for_new(self, live: int) -> str | None:
        """The platform for a sandbox started now, `live` counting it (None:
        runsc.platform). Blocking while the start-up probe of ptrace is still running."""
        if not self._ptrace_when_busy or live <= PTRACE_FROM_PER_CORE * (os.cpu_count() or 1):
            return None
        self._ptrace_probed.wait(timeout=self._probe_timeout_s + 10.0)
        return "ptrace" if self._ptrace_works else None

    def create(self, limits: Limits, system: System | None = None) -> GVisorSandbox:
        return GVisorSandbox(self, self.new_id(), limits, system or self.system)

    def sweep(self) -> None:
        if self.runsc is None:
            self.runsc = Runsc.find(self.config.state_dir / "runsc")
        super().sweep()

    def clean_stale(self, instance_dir: Path) -> None:
        for top in cgroups.tops():  # sessions frozen when it died
            cgroups.thaw_all(f"{top}/{instance_dir.name}")
        if self.runsc is not None:
            stale = Runsc(self.runsc.binary, instance_dir / "runsc", self.runsc.platform)
            for sandbox_id in stale.list_ids():
                stale.kill(sandbox_id)
                stale.delete(sandbox_id)
        for point in mounts.mounts_under(instance_dir):
            mounts.unmount(point)
        for top in cgroups.tops():  # its sandboxes' processes, just killed, may still be ending
            cgroups.remove(f"{top}/{instance_dir.name}", wait_s=STALE_CGROUP_WAIT_S)

    def shutdown(self) -> None:
        if self._ptrace_probe is not None:
            self._ptrace_probe.join()  # its sandbox is closed when it ends
        self.cpu_mover.shutdown()
        if self.state.path.exists():
            for point in mounts.mounts_under(self.state.path):
                mounts.unmount(point)
        for top in cgroups.tops():
            cgroups.remove(f"{top}/{self.state.instance}")
            cgroups.remove_if_empty(top)  # shared by servers side by side: kept while in use
        super().shutdown()


class GVisorSandbox(Sandbox):
    """A kernel in its own runsc sandbox, attached (`runsc run`) through pipes."""

    def __init__(
        self, backend: GVisorBackend, sandbox_id: str, limits: Limits, system: System
    ) -> None:
        self.backend = backend
        self.home = backend.state.path / "sandboxes" / sandbox_id
        # One tmpfs of the disk limit holds everything the session writes (its home, its
        # packages, its layer over the template), so that all of it counts against its disk.
        super().__init__(sandbox_id, self.home / "disk" / "work", limits)
        self.system = system
        self.site_dir: Path = self.disk / "site"
        self.sandbox_pid: int | None = None
        self.frozen = False
        self.file_owner = (system.uid, system.gid)
        self.user = system.user
        self.root_inside = not backend.config.no_root
        kernel = backend.interpreters.for_system(system)
        # The sandbox's process: the kernel (a benchmark may run something else).
        self.command = kernel.command
        self.mounts = kernel.mounts
        self._mounted = False
        self._counted = False  # in backend's count of live sandboxes
        # The platform it runs on: runsc's unless set; after `launch`, the one it runs on.
        self.platform: str | None = None
        self._cpu_group_lock = threading.Lock()  # a move behind against the release
        self._released = False
        self._moved = False  # behind the host's processes (asked for: moves lag a little)
        self._ever_moved = False  # then its CPU time is partly counted behind

    @property
    def disk(self) -> Path:
        return self.home / "disk"

    def use_runtime(self, runtime_dir: Path) -> None:
        kernel = self.backend.interpreters.for_system(self.system, runtime_dir)
        self.command, self.mounts = kernel.command, kernel.mounts

    @property
    def runsc(self) -> Runsc:
        assert self.backend.runsc is not None
        return self.backend.runsc

    def launch(self) -> None:
        try:
            self._launch()
        except Exception as exc:
            self.close(grace_s=1.0)
            raise SandboxStartError(f"could not start sandbox {self.id}: {exc}") from exc

    def _launch(self) -> None:
        backend = self.backend
        # Counted first, in one step with the count it sees: of sandboxes launched at once
        # (a burst), each sees a different count, so that the platform choice holds.
        live = backend.count_live(1)
        self._counted = True
        self.disk.mkdir(parents=True)
        mounts.mount_tmpfs(self.disk, self.limits.disk_mib, 0, 0)
        self._mounted = True
        if self.seed is not None:  # a saved disk: home, packages and layers
            archive.unpack(self.seed, self.disk)
        else:
            for directory in (self.workdir, self.site_dir):
                directory.mkdir(mode=0o700)
                os.chown(directory, self.system.uid, self.system.gid)
        layers.lay(self.system, self.disk, self.home / "root", self.home / "usr")
        bundle = self.home / "bundle"
        bundle.mkdir()
        binds = [Mount(backend.views.of(m.source), m.destination) for m in self.mounts]
        if self.runsc.host_uds:  # its doors: ports' always, egress's with a policy
            self.door_dir = self.home / "door"
            self.door_dir.mkdir(mode=0o755)
            self.door_inside = DOOR_MOUNT
            binds = [*binds, Mount(self.door_dir, DOOR_MOUNT)]
        config = oci_config(
            rootfs=self.home / "root",
            args=self.command,
            system=self.system,
            workdir=self.workdir,
            mounts=binds,
            site_dir=self.site_dir,
            usr_layer=self.home / "usr" if self.system.usr is not None else None,
            root_inside=self.root_inside,
            limits=self.limits,
            cgroups_path=cgroups.cgroups_path(backend.state.instance, self.id),
            cpu_shares=cgroups.SERVING_CPU_SHARES if self.urgent else cgroups.STARTING_CPU_SHARES,
            volumes=self.volumes,
        )
        (bundle / "config.json").write_text(json.dumps(config))
        if backend.cgroups:  # v2: cloche makes the group (see cgroups.install)
            cgroups.install(config["linux"]["cgroupsPath"], config["linux"]["resources"])
        platform = self.platform
        if self.restore_from is not None:  # on the platform that made it: see run_args
            platform = made_on(self.restore_from)
        elif platform is None and not self.for_clones:
            platform = backend.platform_for_new(live)
        self.platform = platform or self.runsc.platform  # its checkpoints record it
        with open(self.home / "runsc.log", "wb") as stderr:
            self.process = subprocess.Popen(
                self.runsc.run_args(
                    bundle, self.id, self.restore_from, self.platform, self.home / "panic.log"
                ),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,  # a Ctrl-C at the server's terminal must not reach it
                bufsize=0,
            )

    def started(self) -> None:
        try:
            self.sandbox_pid = int(self.runsc.state(self.id)["pid"])
        except (RuntimeError, KeyError, ValueError, OSError, subprocess.SubprocessError) as exc:
            log.warning("no pid for sandbox %s (%s): interrupts will use runsc kill", self.id, exc)

    def runtime_log(self) -> str:
        return last_words(self.home / "panic.log", self.home / "runsc.log")

    def freeze(self) -> bool:
        self.frozen = self.backend.cgroups and cgroups.set_frozen(self._cgroup, True)
        if self.frozen and self._ever_moved:  # v2: its processes may be behind
            cgroups.set_frozen(self._behind, True)
        return self.frozen

    def thaw(self) -> None:
        if self.frozen:
            cgroups.set_frozen(self._cgroup, False)
            if self._ever_moved:
                cgroups.set_frozen(self._behind, False)
            self.frozen = False

    def cpu_seconds(self) -> float | None:
        used = cgroups.cpu_usage_s(self._cgroup)
        # Where cpuacct shares the cpu hierarchy, the time spent behind is counted there.
        behind = cgroups.cpu_usage_s(self._behind) if self._ever_moved else None
        return used if behind is None or used is None else used + behind

    def memory_bytes(self) -> int | None:
        if not self.backend.cgroups:
            return None
        used = cgroups.memory_bytes(self._cgroup)
        # On v2, pages faulted in while behind are charged there (cgroups/behind.py).
        behind = cgroups.memory_bytes(self._behind) if self._ever_moved else None
        return used if behind is None or used is None else used + behind

    def oom_killed(self) -> bool:
        if not self.backend.cgroups:
            return False
        return cgroups.oom_killed(self._cgroup) or (
            self._ever_moved and cgroups.oom_killed(self._behind)
        )

    def peers_cpu_seconds(self) -> float | None:
        return cgroups.cpu_usage_s(f"{cgroups.tops()[0]}/{self.backend.state.instance}")

    def checkpoint(
        self, image: Path, *, leave_running: bool = False, compressed: bool = True
    ) -> str | None:
        self.thaw()
        image.mkdir(parents=True, exist_ok=True, mode=0o700)
        why = self.runsc.checkpoint(
            self.id, image, leave_running=leave_running, compressed=compressed
        )
        if why is None:
            (image / MADE_ON).write_text(self.platform or self.runsc.platform)
        return why

    @property
    def _cgroup(self) -> str:
        return cgroups.cgroups_path(self.backend.state.instance, self.id)

    @property
    def _behind(self) -> str:
        return cgroups.behind_path(self.backend.state.instance, self.id)

    def close(self, grace_s: float = 2.0) -> ExitStep:
        self.thaw()  # a frozen kernel could neither exit nor be killed
        return super().close(grace_s)

    def interrupt(self) -> None:
        self.thaw()
        if self.sandbox_pid is not None:
            interrupt_pid(self.sandbox_pid)
        else:
            self.runsc.kill(self.id, "INT")

    def serving(self) -> None:
        path = self._cgroup
        if self.backend.cgroups and not cgroups.set_cpu_shares(path, cgroups.SERVING_CPU_SHARES):
            log.warning("sandbox %s: no CPU weight to raise in cgroup %s", self.id, path)

    def background(self, behind: bool, *, busy: bool = False) -> None:
        """Lower the sandbox's weight among the others; when it is busy too, and the machine
        allows, move its processes, for the CPU alone, to the top-level behind group, so
        that it is behind the host's processes as well (see cgroups.BEHIND). Level: both
        undone. Moves happen in the backend's mover thread."""
        if self.backend.cgroups:
            shares = cgroups.BACKGROUND_CPU_SHARES if behind else cgroups.SERVING_CPU_SHARES
            cgroups.set_cpu_shares(self._cgroup, shares)
        if self.backend.moves_behind and not (behind and not busy):
            self._ask_move(behind)

    @property
    def behind_the_host(self) -> bool:
        return self._moved

    def level_with_the_host(self) -> None:
        self._ask_move(False)

    def _ask_move(self, behind: bool) -> None:
        if behind == self._moved:
            return
        self._moved = behind
        self._ever_moved = self._ever_moved or behind
        with contextlib.suppress(RuntimeError):  # the server has shut down: no need
            self.backend.cpu_mover.submit(self._move, behind)

    def _move(self, behind: bool) -> None:
        with self._cpu_group_lock:
            if self._released:
                return
            if behind:
                cgroups.put_behind(self._cgroup, self._behind)
            else:
                cgroups.bring_level(self._cgroup, self._behind)

    def kill(self) -> None:
        self.thaw()
        if not self.runsc.kill(self.id, "KILL") and self.process is not None:
            self.process.kill()

    def _release(self) -> None:
        if self._counted:
            self._counted = False
            self.backend.count_live(-1)
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.runsc.has_state(self.id):
            self.runsc.delete(self.id)
        cgroups.remove(cgroups.cgroups_path(self.backend.state.instance, self.id))
        with self._cpu_group_lock:
            self._released = True
            cgroups.remove(self._behind)
        if self._mounted:
            for point in mounts.mounts_under(self.home):  # the layers first, then the disk
                mounts.unmount(point)
        shutil.rmtree(self.home, ignore_errors=True)
