"""Saving a running kernel to disk and bringing it back: the durable form of a session.

A save is `checkpoint` of the whole sandbox (memory, threads, open files, /tmp) with the
sandbox left running, plus an archive of its working directory (a host tmpfs, not in the
image). The sandbox goes on as if nothing happened; a pause then closes it. A restore
starts a new sandbox from the image, with the archive laid into its working directory
first, so the files the interpreter had open are found where they were.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import shutil
import time
from pathlib import Path

from cloche.config import Limits
from cloche.errors import CheckpointFailed, RestoreRefused, SandboxStartError, StorageFull
from cloche.sandbox import archive
from cloche.sandbox.base import Backend, SandboxSetup
from cloche.sandbox.layers import SCRATCH_PREFIX, System
from cloche.sessions.kernel import KernelClient
from cloche.sessions.store import IMAGE, WORKDIR_ARCHIVE, Store

log = logging.getLogger("cloche.session")

# Room asked of the data directory's budget before a save: a lean session's image is
# ~2 MiB compressed; a data session's tens of MiB.
EXPECTED_IMAGE_BYTES = 8 * 2**20
RESTORE_TRIES = 2  # a restore that fails to start is tried once more, its cause logged


class Checkpoints:
    """Saves kernels into directories of the store and restores them from there."""

    def __init__(
        self, store: Store, backend: Backend, limits: Limits, max_frame_bytes: int
    ) -> None:
        self.store = store
        self.backend = backend
        self.limits = limits
        self.max_frame_bytes = max_frame_bytes

    def origin(self, runtime: Path | None = None) -> str:
        """What made an image: one made by another runsc or runtime is refused. runtime: a
        profile's own, mounted instead of the server's."""
        own = f" profile runtime {runtime.resolve()}" if runtime is not None else ""
        return self.backend.image_origin() + own

    async def save(self, kernel: KernelClient, home: Path, *, compressed: bool = True) -> int:
        """Checkpoint kernel's sandbox into home (left running), with its working directory;
        the bytes written. An uncompressed image is ~3.5x larger and restores faster: for
        images restored soon and deleted (a fork's).

        Raises:
            StorageFull: the data directory is at its budget or its disk is full.
            CheckpointFailed: runsc could not save it. Either way the sandbox runs on.
        """
        self.store.reserve(EXPECTED_IMAGE_BYTES)
        sandbox = kernel.sandbox

        def save() -> int:
            home.mkdir(mode=0o700, exist_ok=True)
            why = sandbox.checkpoint(home / IMAGE, leave_running=True, compressed=compressed)
            if why is not None:
                if "no space" in why.lower():
                    raise OSError(errno.ENOSPC, why)
                raise CheckpointFailed(f"session could not be saved: {why}")
            pack_disk(sandbox.disk, home / WORKDIR_ARCHIVE)
            return self.store.added(home / IMAGE) + self.store.added(home / WORKDIR_ARCHIVE)

        started = time.perf_counter()
        try:
            size = await asyncio.to_thread(save)
        except BaseException as exc:
            await asyncio.to_thread(self.discard, home)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise StorageFull(
                    f"no space left for the session's image in {self.store.root}: free disk "
                    "space or delete snapshots; the session keeps running"
                ) from exc
            if isinstance(exc, OSError):
                raise CheckpointFailed(f"session could not be saved: {exc}") from exc
            raise
        log.info(
            "checkpoint sandbox=%s bytes=%d ms=%.1f",
            sandbox.id,
            size,
            (time.perf_counter() - started) * 1000,
        )
        return size

    def discard(self, home: Path) -> None:
        """Delete the image and archive in home (blocking), keeping its record."""
        for path in (home / IMAGE, home / WORKDIR_ARCHIVE):
            self.store.remove(path)

    async def restore(
        self,
        home: Path,
        *,
        origin: str,
        reseed: bool,
        limits: Limits | None = None,
        runtime: Path | None = None,
        system: System | None = None,
        setup: SandboxSetup | None = None,
    ) -> KernelClient:
        """A started kernel from the image in home, with a profile's limits and runtime,
        and its template's system; setup is done to its sandbox first (volumes bound).

        Raises:
            RestoreRefused: the image was made elsewhere, is damaged, or did not start.
        """
        here = self.origin(runtime)
        if _across_platforms(origin) != _across_platforms(here):
            raise RestoreRefused(
                f"the image was made by {origin or 'an unknown runtime'}, and this server runs "
                f"{here}: it can't be restored here"
            )
        if not (home / IMAGE).is_dir() or not (home / WORKDIR_ARCHIVE).is_file():
            raise RestoreRefused(f"the image in {home} is incomplete")
        limits = limits or self.limits
        for attempt in range(1, RESTORE_TRIES + 1):
            try:
                return await self._restore_once(home, reseed, limits, runtime, system, setup)
            except SandboxStartError as exc:
                if attempt == RESTORE_TRIES:
                    raise RestoreRefused(f"the image could not be restored: {exc}") from exc
                # Seen once under load (a fork of 10 on two busy cores: runsc's restore
                # ended "exit status 128"); the same image restored at the next try.
                log.warning("restore from %s failed (try %d), trying again: %s", home, attempt, exc)
        raise AssertionError("unreachable")

    async def _restore_once(
        self,
        home: Path,
        reseed: bool,
        limits: Limits,
        runtime: Path | None,
        system: System | None,
        setup: SandboxSetup | None = None,
    ) -> KernelClient:
        """One try of `restore`. Raises SandboxStartError."""
        sandbox = self.backend.create(limits, system)
        if runtime is not None:
            sandbox.use_runtime(runtime)
        if setup is not None:
            await setup(sandbox)
        sandbox.urgent = True
        sandbox.restore_from = home / IMAGE
        sandbox.seed = home / WORKDIR_ARCHIVE
        kernel = KernelClient(sandbox, limits, self.max_frame_bytes)
        kernel.reseed = reseed
        started = time.perf_counter()
        await kernel.start(self.backend.config.sandbox_start_timeout_s)
        sandbox.serving()
        log.info("restore sandbox=%s ms=%.1f", sandbox.id, (time.perf_counter() - started) * 1000)
        return kernel

    def copy_image(self, source: Path, home: Path) -> int:
        """Copy a saved image into home (blocking); its bytes."""
        home.mkdir(mode=0o700, exist_ok=True)
        shutil.copytree(source / IMAGE, home / IMAGE)
        shutil.copy2(source / WORKDIR_ARCHIVE, home / WORKDIR_ARCHIVE)
        return self.store.added(home / IMAGE) + self.store.added(home / WORKDIR_ARCHIVE)


def pack_home(home: Path) -> bytes:
    """A saved session's or snapshot's directory (record, image, disk) as one tar, in memory
    (blocking): what moves it to another node."""
    tar = home.with_name(f".{home.name}.tar")
    try:
        archive.pack(home, tar)
        return tar.read_bytes()
    finally:
        tar.unlink(missing_ok=True)


def unpack_home(data: bytes, home: Path) -> None:
    """Lay out what `pack_home` made, as a new directory (blocking). Raises FileExistsError."""
    tar = home.with_name(f".{home.name}.tar")
    home.mkdir(mode=0o700)
    try:
        tar.write_bytes(data)
        archive.unpack(tar, home)
    except BaseException:
        shutil.rmtree(home, ignore_errors=True)
        raise
    finally:
        tar.unlink(missing_ok=True)


def _across_platforms(origin: str) -> str:
    """An origin without runsc's platform: a server picks ptrace for new sandboxes when
    busy, and restores each image on the platform that made it (`runsc.made_on`), so a
    node that can't run that platform can't take the image (the restore fails)."""
    return re.sub(r" (systrap|ptrace)(?= |$)", "", origin)


def pack_disk(disk: Path, tar: Path) -> int:
    """Save a sandbox's disk (its home, packages and layers; not the overlays' scratch)
    into tar (blocking); its size."""
    return archive.pack(disk, tar, leave_out=lambda name: name.startswith(SCRATCH_PREFIX))
