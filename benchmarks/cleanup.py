"""What a benchmark run leaves behind, checked: runsc processes (its own and others'),
mounts and cgroups; and its scratch directory, removed with whatever still holds it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from cloche.sandbox import mounts


def runsc_processes() -> list[str]:
    done = subprocess.run(["pgrep", "-af", "runsc"], capture_output=True, text=True)
    return [line for line in done.stdout.splitlines() if line.strip()]


def foreign_runsc(base: Path) -> list[str]:
    """runsc processes that this run did not start (another server, another test run)."""
    return [p for p in runsc_processes() if str(base) not in p]


def leftovers(base: Path) -> list[str]:
    """What this run left behind: runsc processes, mounts, cgroups."""
    found = [f"process: {p}" for p in runsc_processes() if str(base) in p]
    found += [f"mount: {p}" for p in mounts.mounts_under(base)]
    # Every state directory this process claimed is named <pid>-<random>.
    found += [f"cgroup: {p}" for p in Path("/sys/fs/cgroup").glob(f"*/cloche/{os.getpid()}-*")]
    return found


def runsc_root(command_line: str) -> str:
    """The --root of a runsc command line (which server or test run it belongs to)."""
    match = re.search(r"--root[= ](\S+)", command_line)
    return match.group(1) if match else command_line[:120]


@contextmanager
def scratch_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="cloche-bench-"))
    try:
        yield base
    finally:
        # After a crash mid-run, sandboxes of ours may still hold their mounts: their runsc
        # processes name this directory (ours alone, from mkdtemp) on their command lines.
        for pid in processes_mentioning(str(base)):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for point in mounts.mounts_under(base):
            mounts.unmount(point)
        shutil.rmtree(base, ignore_errors=True)


def processes_mentioning(text: str) -> list[int]:
    """Processes (other than this one) whose command line contains text."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found
