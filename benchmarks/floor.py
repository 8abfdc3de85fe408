"""The floor of a cell: a frame echoed through a runsc sandbox's pipes.

The sandbox is built by cloche's own gVisor backend (same rootfs, mounts, limits, cgroup,
runsc flags), running a tiny echo loop instead of the kernel; the same loop as a plain
subprocess gives the unsandboxed figure, for context.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from cloche.config import Limits, ServerConfig
from cloche.protocol.framing import encode_frame
from cloche.sandbox.gvisor import GVisorBackend, GVisorSandbox

# Echo whatever arrives on fd 0 back to fd 1; one byte first, to say it is up.
ECHO_LOOP = (
    "import os\n"
    "os.write(1, b'R')\n"
    "while True:\n"
    "    data = os.read(0, 65536)\n"
    "    if not data:\n"
    "        break\n"
    "    os.write(1, data)\n"
)
# A frame like the host sends the kernel: 4-byte length + JSON, 47 bytes in all.
MESSAGE = encode_frame({"op": "exec", "code": "1+1", "output_limit": 1})
WARMUP_S = 1.5  # clock_gettime traps for about a sandbox's first second (vDSO calibration)


class CommandSandbox(GVisorSandbox):
    """A cloche gVisor sandbox whose process is `command` instead of the kernel.

    Everything else (rootfs, mounts, working-directory tmpfs, limits, cgroup, runsc flags,
    close, kill, cleanup) is GVisorSandbox's own.
    """

    def __init__(self, backend: GVisorBackend, command: list[str], limits: Limits) -> None:
        super().__init__(backend, backend.new_id(), limits)
        self.command = command


class Echo:
    """Round trips of MESSAGE to an echo process that has already said 'R'."""

    def __init__(self, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        self.write_fd = stdin.fileno()
        self.read_fd = stdout.fileno()

    def once(self) -> None:
        os.write(self.write_fd, MESSAGE)
        got = 0
        while got < len(MESSAGE):
            chunk = os.read(self.read_fd, 65536)
            if not chunk:
                raise RuntimeError("the echo process closed its pipe")
            got += len(chunk)

    def timed(self, count: int) -> list[float]:
        """count round trips, in µs."""
        samples: list[float] = []
        for _ in range(count):
            started = time.perf_counter_ns()
            self.once()
            samples.append((time.perf_counter_ns() - started) / 1000)
        return samples

    def warm_up(self, count: int, min_s: float) -> None:
        until = time.perf_counter() + min_s
        done = 0
        while done < count or time.perf_counter() < until:
            self.once()
            done += 1


def wait_ready(stdout: IO[bytes], what: str, log_text: str = "", timeout_s: float = 30.0) -> None:
    ready, _, _ = select.select([stdout], [], [], timeout_s)
    if not ready or os.read(stdout.fileno(), 1) != b"R":
        raise RuntimeError(f"{what} did not start: {log_text}")


class Floor:
    """cloche's gVisor backend, prepared, with one echo sandbox running."""

    def __init__(self, state_dir: Path) -> None:
        config = ServerConfig(backend="gvisor", state_dir=state_dir, runtime_dir=None)
        self.backend = GVisorBackend(config)
        self.limits = Limits()
        self.sandbox: CommandSandbox | None = None
        self.echo: Echo | None = None

    def __enter__(self) -> Floor:
        try:
            self.backend.prepare()
            self.sandbox = CommandSandbox(
                self.backend, [self.backend.python, "-S", "-c", ECHO_LOOP], self.limits
            )
            self.sandbox.launch()
            wait_ready(self.sandbox.stdout, "the echo sandbox", self.sandbox.startup_log())
            self.echo = Echo(self.sandbox.stdin, self.sandbox.stdout)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close(grace_s=5.0)
            self.sandbox = None
        self.backend.shutdown()

    def cold_run(self) -> float:
        """One attached `runsc run` of `python3 -S -c pass`, start to exit, in ms."""
        sandbox = CommandSandbox(
            self.backend, [self.backend.python, "-S", "-c", "pass"], self.limits
        )
        try:
            started = time.perf_counter()
            sandbox.launch()
            code = sandbox.wait(60.0)
            elapsed = (time.perf_counter() - started) * 1000
            if code != 0:
                raise RuntimeError(f"runsc run exited {code}: {sandbox.startup_log()}")
            return elapsed
        finally:
            sandbox.close(grace_s=5.0)


def measure_unsandboxed(count: int) -> list[float]:
    """The same echo loop as a plain subprocess (no gVisor), for context; in µs."""
    process = subprocess.Popen(
        [sys.executable, "-S", "-c", ECHO_LOOP], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        wait_ready(process.stdout, "the unsandboxed echo process")
        echo = Echo(process.stdin, process.stdout)
        echo.warm_up(max(200, count // 10), 0.2)
        return echo.timed(count)
    finally:
        process.stdin.close()
        process.wait(10)
        process.stdout.close()
