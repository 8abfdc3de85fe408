"""The Docker engine for the tests that need one (the container image's, the templates'):
`docker()` runs its CLI, `Daemon` starts dockerd when none answers (and stops it then)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from support import slowness

# The documented minimum for runsc (root mode) inside a container; AppArmor's docker-default
# profile, where the kernel has AppArmor (Debian's), denies mount.
RUN_FLAGS = (
    "--cap-add",
    "SYS_ADMIN",
    "--security-opt",
    "seccomp=unconfined",
    "--security-opt",
    "apparmor=unconfined",
)


def docker(*args: str, timeout_s: float = 120.0, check: bool = True) -> str:
    """docker's output; timeout_s as on this project's machines (scaled by slowness())."""
    done = subprocess.run(
        ["docker", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s * slowness(),
        check=False,
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def daemon_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    done = subprocess.run(
        ["docker", "info"], capture_output=True, timeout=30 * slowness(), check=False
    )
    return done.returncode == 0


class Daemon:
    """dockerd, started by this object only when none answers (and stopped by it then)."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def ensure(self) -> None:
        if daemon_answers():
            return
        if os.geteuid() != 0 or shutil.which("dockerd") is None:
            message = "no Docker daemon, and dockerd can't be started here (install docker.io)"
            if os.environ.get("CLOCHE_TEST_ALLOW_NO_DOCKER") == "1":
                pytest.skip(message)
            pytest.fail(message)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(["dockerd"], stdout=log, stderr=log)
        deadline = time.monotonic() + 60 * slowness()
        while not daemon_answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail("dockerd did not start:\n" + self.log_path.read_text()[-2000:])
            time.sleep(0.5)  # polling for the daemon, with a deadline

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # dockerd stops its containers and exits
            self.process.wait(60 * slowness())
        self.process = None
