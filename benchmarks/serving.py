"""`cloche serve` as a child process of a benchmark (free ports, its log in a file), and
what its sandboxes hold: processes, PSS, cgroup memory, CPU.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from cleanup import processes_mentioning
from cloche.bench import Target


class Serve:
    """`cloche serve` as a child process on free ports; its log goes to a file.

    The log goes to the file directly: a thread of this process copying it would wake for
    every cell's log line and take the GIL from the clients being timed."""

    def __init__(self, state: Path, *args: str) -> None:
        self.state = state
        state.mkdir(parents=True, exist_ok=True)
        self.log_path = state.with_suffix(".log")
        command = [
            sys.executable,
            "-m",
            "cloche.cli",
            "serve",
            "--tcp-port",
            "0",
            "--http-port",
            "0",
            "--state-dir",
            str(state),
            *args,
        ]
        with self.log_path.open("w") as log_file:
            self.process = subprocess.Popen(command, stderr=log_file)
        until = time.monotonic() + 300
        while not (match := re.search(r"listening tcp=\S+:(\d+) http=\S+:(\d+)", self.log())):
            if self.process.poll() is not None or time.monotonic() > until:
                raise RuntimeError(f"cloche serve did not start; see {self.log_path}")
            time.sleep(0.1)  # polling its log for the line that gives the ports
        self.tcp_port, self.http_port = int(match[1]), int(match[2])
        self.target = Target(url=f"http://127.0.0.1:{self.http_port}", tcp_port=self.tcp_port)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start_times_ms(self, profile: str) -> dict[str, list[float]]:
        """How long the server took to start the profile's sandboxes (from its log): afresh
        (with the preload), restored from its template, and checkpointing the template."""
        text = self.log()
        found = {
            "afresh": rf"sandbox started id=\S+ profile={profile} start_ms=([\d.]+) restored=no",
            "restored": rf"sandbox started id=\S+ profile={profile} start_ms=([\d.]+) restored=yes",
            "template": rf"template made profile={profile} start_ms=([\d.]+)",
            "checkpoint": rf"template made profile={profile} start_ms=\S+ checkpoint_ms=([\d.]+)",
        }
        times = {name: [float(x) for x in re.findall(p, text)] for name, p in found.items()}
        times["afresh"] += times.pop("template")  # the template is a start afresh too
        return times

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.target.url}/metrics", timeout=30).text
        wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pattern = re.escape(name + (f"{{{wanted}}}" if wanted else "")) + r" (\S+)"
        match = re.search("^" + pattern + "$", text, re.MULTILINE)
        return float(match[1]) if match else 0.0

    def wait_pooled(self, profile: str, count: int, timeout_s: float = 300.0) -> None:
        until = time.monotonic() + timeout_s
        while self.metric("cloche_sessions_pooled", profile=profile) < count:
            if time.monotonic() > until:
                raise RuntimeError(f"the {profile} pool did not reach {count}")
            time.sleep(0.25)  # polling /metrics costs the server CPU that a start would use

    def sandbox_pss_kib(self) -> tuple[int, int]:
        """(how many runsc processes, their summed PSS) of this server's sandboxes."""
        return pss_of(self.sandbox_pids())

    def sandbox_pids(self) -> list[int]:
        """runsc processes of this server's sandboxes (the server's own command line names
        its state directory too)."""
        return [p for p in processes_mentioning(str(self.state)) if p != self.process.pid]

    def sandbox_cpu_pct(self, seconds: float) -> float:
        """CPU used by this server's sandbox processes over `seconds`, in % of one core."""

        def ticks() -> int:
            total = 0
            for pid in self.sandbox_pids():
                with contextlib.suppress(OSError, IndexError):
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    total += int(fields[11]) + int(fields[12])  # utime + stime
            return total

        before = ticks()
        time.sleep(seconds)
        return (ticks() - before) / os.sysconf("SC_CLK_TCK") / seconds * 100

    def sandbox_cgroup_mib(self) -> float:
        """Memory charged to this server's sandbox cgroups (cgroup v1: usage_in_bytes,
        which counts gVisor's memory file as PSS can't when no process maps a page)."""
        total = 0
        for lock in self.state.glob("*.lock"):
            top = Path("/sys/fs/cgroup/memory/cloche") / lock.stem
            for usage in top.glob("*/memory.usage_in_bytes"):
                with contextlib.suppress(OSError):
                    total += int(usage.read_text())
        return total / 1024 / 1024

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(120)


@contextlib.contextmanager
def serving(state: Path, *args: str) -> Iterator[Serve]:
    server = Serve(state, *args)
    try:
        yield server
    finally:
        server.stop()


def pss_of(pids: list[int]) -> tuple[int, int]:
    total = 0
    counted = 0
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        match = re.search(r"^Pss:\s+(\d+) kB", rollup, re.MULTILINE)
        if match:
            total += int(match[1])
            counted += 1
    return counted, total


def mem_available_kib() -> int:
    match = re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    assert match
    return int(match[1])
