"""Calling the runsc binary: finding it, its flags, and its state/kill/delete commands."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from functools import cached_property
from pathlib import Path
from typing import Any

from cloche.errors import BackendUnavailable
from cloche.sandbox.base import CRASH_STARTS

INSTALL_HINT = (
    "install gVisor's runsc (on Debian/Ubuntu, ./run.sh does it; elsewhere see "
    "https://gvisor.dev/docs/user_guide/install/), or run with --backend unsafe-local, "
    "which is NOT isolated"
)


# The file a checkpoint image carries beside runsc's own: the platform that made it.
MADE_ON = "cloche-platform"
KNOWN_PLATFORMS = ("systrap", "ptrace", "kvm")  # runsc's names (cloche tries fewer)


def made_on(image: Path) -> str | None:
    """The platform that made a checkpoint image (see `MADE_ON`); None when it doesn't say
    (an image from before cloche recorded it) or says something that isn't a platform."""
    try:
        said = (image / MADE_ON).read_text().strip()
    except OSError:
        return None
    return said if said in KNOWN_PLATFORMS else None


def last_words(*logs: Path) -> str:
    """What runsc wrote to logs (the sentry's panic log, its own stderr) before it
    ended: a Go crash's first lines (from `CRASH_STARTS`; the goroutine dump after them
    is long) when there is one, else the last lines; empty when it wrote nothing."""
    texts = []
    for path in logs:
        with contextlib.suppress(OSError):
            texts.append(path.read_text(errors="replace").strip())
    text = "\n".join(t for t in texts if t)
    crash = re.search("^(" + "|".join(map(re.escape, CRASH_STARTS)) + ")", text, re.MULTILINE)
    return text[crash.start() :][:1000] if crash else text[-2000:]


class Runsc:
    """One runsc binary with one state root (`--root`) and platform."""

    def __init__(self, binary: str, root: Path, platform: str = "systrap") -> None:
        self.binary = binary
        self.root = root
        self.platform = platform
        self.ignore_cgroups = False  # sandboxes without cgroups (and their limits)
        # A sandbox may connect to a host unix socket in its mounts (its doors, the only
        # ones it sees): the ports' door always, egress's with --egress-policy.
        self.host_uds = False

    @classmethod
    def find(cls, root: Path) -> Runsc:
        binary = shutil.which("runsc")
        if binary is None:
            raise BackendUnavailable(f"runsc was not found on PATH: {INSTALL_HINT}")
        runsc = cls(binary, root)
        try:
            runsc.version  # noqa: B018  # runs `runsc --version`
        except (OSError, subprocess.SubprocessError) as exc:
            raise BackendUnavailable(
                f"runsc at {binary} does not run ({exc}): {INSTALL_HINT}"
            ) from exc
        return runsc

    @cached_property
    def version(self) -> str:
        out = subprocess.run(
            [self.binary, "--version"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
        match = re.search(r"runsc version (\S+)", out)
        return match.group(1) if match else out.strip().splitlines()[0]

    @cached_property
    def flags(self) -> set[str]:
        out = subprocess.run(
            [self.binary, "flags"], capture_output=True, text=True, timeout=10
        ).stderr
        return set(re.findall(r"^\s+-([\w-]+)", out, re.MULTILINE))

    def global_args(self, platform: str | None = None) -> list[str]:
        args = [
            self.binary,
            "--root",
            str(self.root),
            "--network=none",
            f"--platform={platform or self.platform}",
        ]
        if "overlay2" in self.flags:
            args.append("--overlay2=none")  # writes go to the mounts we chose, nowhere else
        if self.ignore_cgroups:
            args.append("--ignore-cgroups")  # no writable cgroups (a container's default)
        if self.host_uds:
            args.append("--host-uds=open")
        return args

    def run_args(
        self,
        bundle: Path,
        sandbox_id: str,
        image: Path | None = None,
        platform: str | None = None,
        panic_log: Path | None = None,
    ) -> list[str]:
        """`runsc run`, attached; or, given a checkpoint image, `runsc restore` of it, on
        platform (else self.platform). An image must be restored on the platform that made
        it (`made_on`): runsc 0.0~20240729 crashes restoring a systrap image on ptrace, and
        a ptrace image restored on systrap starts but wedges about half the time (its
        processes spin in the sentry's brk; benchmarks/image_pause_wedge.py). The sentry's
        own stderr is /dev/null: a panic of it is written to panic_log, if given."""
        args = self.global_args(platform)
        if panic_log is not None and "panic-log" in self.flags:
            args.append(f"--panic-log={panic_log}")
        if image is not None:
            return [
                *args,
                "restore",
                "--image-path",
                str(image),
                "--bundle",
                str(bundle),
                sandbox_id,
            ]
        return [*args, "run", "--bundle", str(bundle), sandbox_id]

    @cached_property
    def checkpoint_flags(self) -> set[str]:
        out = subprocess.run(
            [self.binary, "checkpoint", "--help"], capture_output=True, text=True, timeout=10
        )
        return set(re.findall(r"^\s+-([\w-]+)", out.stdout + out.stderr, re.MULTILINE))

    def checkpoint(
        self,
        sandbox_id: str,
        image: Path,
        *,
        leave_running: bool = False,
        compressed: bool = True,
    ) -> str | None:
        """Save a running sandbox into image; None, or why it failed. The sandbox stops,
        unless leave_running: then it goes on as if nothing happened (its pipes too).

        An uncompressed image is ~3.5x larger (141 against 39 MB for the data profile) and
        restores ~2x faster: nothing to inflate, which is a burst's bottleneck on few cores.
        """
        options = ["--leave-running"] if leave_running else []
        if not compressed and "compression" in self.checkpoint_flags:
            options.append("--compression=none")
            if "exclude-committed-zero-pages" in self.checkpoint_flags:
                options.append("--exclude-committed-zero-pages")
        done = self._call(
            "checkpoint", *options, "--image-path", str(image), sandbox_id, timeout_s=120.0
        )
        return None if done.returncode == 0 else (done.stderr.strip() or "no reason given")

    def _call(self, *args: str, timeout_s: float = 10.0) -> subprocess.CompletedProcess[str]:
        """Run a runsc command; one that outlives timeout_s is killed and reported as failed
        (on a machine starting hundreds of sandboxes, even `runsc kill` can be that slow),
        so that callers fall back as they do for any failure instead of raising."""
        command = [self.binary, "--root", str(self.root), *args]
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(
                command, -1, "", f"runsc {args[0]} did not finish within {timeout_s:g} s"
            )

    def state(self, sandbox_id: str) -> dict[str, Any]:
        done = self._call("state", sandbox_id)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip())
        state: dict[str, Any] = json.loads(done.stdout)
        return state

    def kill(self, sandbox_id: str, signal_name: str = "KILL") -> bool:
        return self._call("kill", sandbox_id, signal_name).returncode == 0

    def delete(self, sandbox_id: str) -> None:
        self._call("delete", "--force", sandbox_id, timeout_s=30.0)

    def list_ids(self) -> list[str]:
        if not self.root.exists():
            return []
        done = self._call("list", "-quiet")
        return done.stdout.split() if done.returncode == 0 else []

    def has_state(self, sandbox_id: str) -> bool:
        return any(self.root.glob(f"*{sandbox_id}*"))
