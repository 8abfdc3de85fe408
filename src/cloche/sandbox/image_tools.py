"""The processes a template's build runs: cloche's chrooted helper (`sandbox/rootfs.py`),
skopeo and umoci (and, from `sandbox/docker_engine.py`, the Docker engine's CLI).

Each runs in a process group of its own, its lines going into the build's log as they come;
a build cut short kills the group. A tool that fails raises `TemplateFailed` with its own
last line (skopeo's, umoci's, docker's, or the helper's refusal naming the member).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cloche.errors import TemplateFailed

# The tool's own words, a line at a time; longer lines are cut (docker's progress bars).
MAX_LINE_CHARS = 2000
_READ_BYTES = 64 * 1024
_LINE_END = re.compile(rb"[\r\n]")
HELPER = Path(__file__).with_name("rootfs.py")
# skopeo checks signatures by policy; the local transports cloche reads carry none.
_POLICY = {"default": [{"type": "insecureAcceptAnything"}]}


class Progress(abc.ABC):
    """Where a build's lines and progress go."""

    @abc.abstractmethod
    def line(self, text: str) -> None:
        """One line of a tool's output."""

    @abc.abstractmethod
    def update(self, **progress: Any) -> None:
        """Merge into the build's progress ({"phase", "read_bytes", ...})."""


def require_root() -> None:
    """Raises TemplateFailed unless this process is root (the helper chroots; umoci keeps
    the image's owners only as root)."""
    if os.geteuid() != 0:
        raise TemplateFailed("building a template needs root: run `cloche serve` as root")


async def _lines(stream: asyncio.StreamReader) -> AsyncIterator[str]:
    pending = b""
    while chunk := await stream.read(_READ_BYTES):
        *done, pending = _LINE_END.split(pending + chunk)
        if len(pending) > MAX_LINE_CHARS:
            done.append(pending)
            pending = b""
        for raw in done:
            if raw.strip():
                yield raw.decode(errors="replace")[:MAX_LINE_CHARS]
    if pending.strip():
        yield pending.decode(errors="replace")[:MAX_LINE_CHARS]


async def run(
    argv: Sequence[str],
    progress: Progress,
    what: str,
    *,
    on_stdout: Callable[[str], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Run a tool to its end; its lines go to progress (stdout's to on_stdout if given).

    Raises:
        TemplateFailed: the tool is missing, or exited non-zero (with its last line).
        asyncio.CancelledError: cut short: the tool's process group is killed first.
    """
    if shutil.which(argv[0]) is None:
        raise TemplateFailed(
            f"{argv[0]} is not installed on the server (scripts/install.sh installs it)"
        )
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=dict(env) if env is not None else None,
    )
    errors: list[str] = []

    def error(text: str) -> None:
        errors.append(text)
        del errors[:-1]
        progress.line(text)

    async def pump(stream: asyncio.StreamReader | None, sink: Callable[[str], None]) -> None:
        assert stream is not None
        async for text in _lines(stream):
            sink(text)

    try:
        await asyncio.gather(
            pump(process.stdout, on_stdout or progress.line), pump(process.stderr, error)
        )
        code = await process.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise
    if code != 0:
        why = errors[-1] if errors else f"exit status {code}"
        raise TemplateFailed(f"{what} failed: {why}")


async def helper(progress: Progress, *args: str) -> dict[str, Any]:
    """cloche's chrooted helper (extract ARCHIVE ROOT, or finish ROOT), run isolated (-I -S:
    no environment, no site-packages) on this interpreter; the result it printed, if any."""
    require_root()
    result: dict[str, Any] = {}

    def said(text: str) -> None:
        try:
            message = json.loads(text)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            progress.line(text)
        elif isinstance(message.get("progress"), dict):
            progress.update(**message["progress"])
        elif isinstance(message.get("result"), dict):
            result.update(message["result"])

    argv = [sys.executable, "-I", "-S", str(HELPER), *args]
    await run(argv, progress, f"{args[0]} (cloche's rootfs helper)", on_stdout=said)
    return result


async def skopeo_copy(source: str, destination: str, work: Path, progress: Progress) -> None:
    """`skopeo copy` of an image between transports; its temporary files go into work.
    Layers are gzipped (umoci 0.4 unpacks no other), quickly (level 1)."""
    policy = work / "policy.json"
    await asyncio.to_thread(policy.write_text, json.dumps(_POLICY))
    argv = ["skopeo", "--policy", str(policy), "copy", "--dest-compress-level", "1"]
    env = {**os.environ, "TMPDIR": str(work)}
    await run([*argv, source, destination], progress, "skopeo copy", env=env)


async def umoci_unpack(image: str, rootfs: Path, progress: Progress) -> None:
    """`umoci raw unpack` (as root: owners kept) of an OCI layout's image into rootfs,
    applying its layers in order, whiteouts and all."""
    require_root()
    await run(["umoci", "raw", "unpack", "--image", image, str(rootfs)], progress, "umoci unpack")
