"""The warm pool: sandboxes started ahead of need, so a new session doesn't wait for one.

Refills run in the background, a bounded number at a time (starting a sandbox costs a
core for ~0.2 s; starting many at once would starve running cells). A sandbox taken from
the pool is checked alive first: the pool never hands out a dead one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from cloche.config import Limits
from cloche.errors import SandboxStartError
from cloche.sandbox.base import Backend, ExitStep, SandboxSetup
from cloche.sessions.durable import pack_disk
from cloche.sessions.kernel import KernelClient
from cloche.sessions.profiles import Profile
from cloche.sessions.result import CellStatus

log = logging.getLogger("cloche.pool")

START_ATTEMPTS = 3
PRELOAD_TIMEOUT_S = 180.0
# A refill begins this long after a take, not at once: a sandbox start keeps the cores busy
# for ~0.3 s, just when the session taken runs its first cells (measured on 2 cores: the
# first cell after a pool hit, p50 5.6 ms with an immediate refill, 4.0 ms with this).
REFILL_DELAY_S = 0.2
# A pool grows beyond its size to the largest burst of takes seen lately: the takes within
# BURST_S of each other, remembered for DEMAND_WINDOW_S. Ready sandboxes beyond that are
# closed (looked at every SHRINK_CHECK_S), so the pool shrinks back when demand falls.
BURST_S = 2.0
DEMAND_WINDOW_S = 60.0
SHRINK_CHECK_S = 5.0


class WarmPool:
    """Keeps `size` started kernels of one profile ready; `take()` returns one at once when
    it can."""

    def __init__(
        self,
        backend: Backend,
        limits: Limits,
        profile: Profile,
        *,
        size: int,
        max_frame_bytes: int,
        start_concurrency: int = 0,
        max_size: int = 0,
    ) -> None:
        self.backend = backend
        self.limits = limits
        self.profile = profile
        self.size = size
        self.max_size = max(size, max_size)  # what demand may grow it to
        self._recent_takes: deque[float] = deque()  # monotonic times, within BURST_S
        self._bursts: deque[tuple[float, int]] = deque()  # (when, takes within BURST_S)
        self.max_frame_bytes = max_frame_bytes
        self._ready: deque[KernelClient] = deque()
        self._starting = 0
        self._starts = asyncio.Semaphore(start_concurrency or os.cpu_count() or 1)
        self._wanted = asyncio.Event()  # set when the pool may be below its size
        self._added = asyncio.Event()  # set when a kernel joins the pool
        self._refill_task: asyncio.Task[None] | None = None
        self._refill_timer: asyncio.TimerHandle | None = None
        self._image_lock = asyncio.Lock()
        self._image: Path | None = None  # the profile's checkpoint, once made
        self._no_image = False  # the backend can't checkpoint, or restoring failed
        self._closed = False
        self._shrinking: set[asyncio.Task[ExitStep]] = set()
        # Starts for waiting sessions in flight: refills hold back until they are done (on
        # a few cores, a refill beside them makes every waiting session later).
        self._missing = 0
        self._no_misses = asyncio.Event()
        self._no_misses.set()
        self.hits = 0
        self.misses = 0
        self.start_failures = 0
        self.last_start_ok = True  # whether the most recent sandbox start succeeded
        # Told of every start: (profile, seconds, succeeded).
        self.on_start: Callable[[str, float, bool], None] = lambda *_: None

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    @property
    def target(self) -> int:
        """How many ready kernels the pool aims for: its size, or the largest recent burst
        of takes, up to max_size."""
        now = time.monotonic()
        while self._bursts and now - self._bursts[0][0] > DEMAND_WINDOW_S:
            self._bursts.popleft()
        peak = max((count for _, count in self._bursts), default=0)
        return max(self.size, min(self.max_size, peak))

    def _count_take(self) -> None:
        now = time.monotonic()
        takes = self._recent_takes
        takes.append(now)
        while now - takes[0] > BURST_S:
            takes.popleft()
        self._bursts.append((now, len(takes)))

    def start(self) -> None:
        self._refill_task = asyncio.create_task(self._refill(), name="cloche-pool-refill")
        self._wanted.set()

    async def wait_full(self, timeout_s: float = 120.0) -> None:
        """Wait until the pool holds `size` ready kernels (for start-up and tests)."""
        async with asyncio.timeout(timeout_s):
            while len(self._ready) < self.size:
                self._added.clear()
                await self._added.wait()

    async def take(self) -> KernelClient:
        """A started kernel: from the pool when one is ready, else started now.

        Raises:
            SandboxStartError: no sandbox could be started.
        """
        self._count_take()
        while self._ready:
            kernel = self._ready.popleft()
            self._refill_soon()
            if kernel.alive:
                self.hits += 1
                kernel.sandbox.serving()
                return kernel
            log.warning("pooled sandbox %s died while waiting: %s", kernel.id, kernel.death)
            await kernel.close()
        self.misses += 1
        self._refill_soon()
        self._missing += 1
        self._no_misses.clear()
        try:
            kernel = await self._start_with_retries(urgent=True)
        finally:
            self._missing -= 1
            if not self._missing:
                self._no_misses.set()
        kernel.sandbox.serving()
        return kernel

    def _refill_soon(self) -> None:
        """Refill after REFILL_DELAY_S (one timer for a burst of takes)."""
        if self._refill_timer is None and not self._closed:
            self._refill_timer = asyncio.get_running_loop().call_later(
                REFILL_DELAY_S, self._refill_now
            )

    def _refill_now(self) -> None:
        self._refill_timer = None
        self._wanted.set()

    async def _start_with_retries(self, *, urgent: bool = False) -> KernelClient:
        error: Exception | None = None
        for attempt in range(1, START_ATTEMPTS + 1):
            image = await self._checkpoint_image() if self.profile.restored else None
            started = time.perf_counter()
            try:
                kernel = await self._start(urgent, image)
            except SandboxStartError as exc:
                if image is not None:
                    log.warning(
                        "restoring the %s template failed, starting afresh from now on: %s",
                        self.profile.name,
                        exc,
                    )
                    self._image, self._no_image = None, True
                self.start_failures += 1
                self.last_start_ok = False
                self.on_start(self.profile.name, time.perf_counter() - started, False)
                error = exc
                log.warning(
                    "sandbox start failed (attempt %d/%d): %s", attempt, START_ATTEMPTS, exc
                )
                await asyncio.sleep(0.1 * attempt)
                continue
            self.last_start_ok = True
            self.on_start(self.profile.name, time.perf_counter() - started, True)
            log.info(
                "sandbox started id=%s profile=%s start_ms=%.1f restored=%s",
                kernel.id,
                self.profile.name,
                (time.perf_counter() - started) * 1000,
                "yes" if image is not None else "no",
            )
            return kernel
        raise SandboxStartError(
            f"no sandbox could be started after {START_ATTEMPTS} attempts: {error}"
        ) from error

    async def start_on(self, disk: Path, setup: SandboxSetup | None = None) -> KernelClient:
        """A kernel of the profile started afresh, at once (not from the pool), on a saved
        disk (a restarted session's files, packages and system layer); its sandbox set up
        by setup first (its volumes bound).

        Raises:
            SandboxStartError: it did not start.
        """
        return await self._start(True, seed=disk, setup=setup)

    async def start_for(self, setup: SandboxSetup | None) -> KernelClient:
        """A kernel of the profile at once, not from the pool, its sandbox set up by setup
        first (a new session's volumes bound): the profile's image restored into it when
        the pool restores one (runsc takes mounts its checkpoint did not have), else
        started afresh.

        Raises:
            SandboxStartError: it did not start.
        """
        image = await self._checkpoint_image() if self.profile.restored else None
        if image is not None:
            try:
                return await self._start(True, image, setup=setup)
            except SandboxStartError as exc:
                log.warning(
                    "restoring the %s template failed, starting afresh: %s", self.profile.name, exc
                )
        return await self._start(True, setup=setup)

    async def _start(
        self,
        urgent: bool,
        image: Path | None = None,
        seed: Path | None = None,
        setup: SandboxSetup | None = None,
        for_clones: bool = False,
    ) -> KernelClient:
        """A started kernel of the profile: restored from image, or started and preloaded
        (on the disk saved in seed, if given); setup done to its sandbox first. for_clones:
        the one whose checkpoint is the pool's image (see `Sandbox.for_clones`).

        Raises:
            SandboxStartError: it did not start.
        """
        sandbox = self.backend.create(self.limits, self.profile.system)
        if self.profile.runtime_dir is not None:  # a profile from --profiles: its own runtime
            sandbox.use_runtime(self.profile.runtime_dir)
        if setup is not None:
            await setup(sandbox)
        sandbox.urgent = urgent
        sandbox.for_clones = for_clones
        sandbox.restore_from = image
        sandbox.seed = seed
        if image is not None:  # what its disk held (its layer: caches written while loading)
            sandbox.seed = image.with_name(f"{image.name}.disk.tar")
        kernel = KernelClient(sandbox, self.limits, self.max_frame_bytes)
        try:
            await kernel.start(self.backend.config.sandbox_start_timeout_s)
            if image is None:
                await self._preload(kernel)
        except BaseException:
            await kernel.close()  # idempotent; also when cancelled mid-preload
            raise
        return kernel

    async def _checkpoint_image(self) -> Path | None:
        """The checkpoint image the pool restores, made by the first call; None when the
        backend can't checkpoint (starting afresh then)."""
        async with self._image_lock:
            if self._image is not None or self._no_image:
                return self._image
            image = self.backend.state.path / "templates" / self.profile.name
            started = time.perf_counter()
            try:
                kernel = await self._start(urgent=True, for_clones=True)
            except SandboxStartError as exc:
                log.warning("no %s template (%s): starting afresh", self.profile.name, exc)
                self._no_image = True
                return None
            saving = time.perf_counter()
            try:
                # Uncompressed: a burst of misses restores it many times at once.
                why = await asyncio.to_thread(
                    functools.partial(kernel.sandbox.checkpoint, image, compressed=False)
                )
                if why is None:
                    await asyncio.to_thread(
                        pack_disk, kernel.sandbox.disk, image.with_name(f"{image.name}.disk.tar")
                    )
            finally:
                await kernel.close(why="checkpointed as the template")
            if why is not None:
                log.warning("no %s template (%s): starting afresh", self.profile.name, why)
                self._no_image = True
                return None
            log.info(
                "template made profile=%s start_ms=%.1f checkpoint_ms=%.1f",
                self.profile.name,
                (saving - started) * 1000,
                (time.perf_counter() - saving) * 1000,
            )
            self._image = image
            return image

    async def _preload(self, kernel: KernelClient) -> None:
        if not self.profile.preload:
            return
        result = await kernel.execute(
            self.profile.preload, timeout_s=PRELOAD_TIMEOUT_S, silent=True
        )
        if result.status is not CellStatus.OK:
            detail = result.error["evalue"] if result.error else result.message
            raise SandboxStartError(f"the {self.profile.name} profile failed to load: {detail}")

    async def _refill(self) -> None:
        pending: set[asyncio.Task[None]] = set()
        try:
            while not self._closed:
                try:
                    async with asyncio.timeout(SHRINK_CHECK_S):
                        await self._wanted.wait()
                except TimeoutError:
                    self._shrink()
                    continue
                self._wanted.clear()
                while len(self._ready) + self._starting < self.target and not self._closed:
                    self._starting += 1
                    task = asyncio.create_task(self._add_one())
                    pending.add(task)
                    task.add_done_callback(pending.discard)
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def _shrink(self) -> None:
        """Close ready kernels beyond the target (demand fell), the oldest first."""
        excess = len(self._ready) - self.target
        for _ in range(max(0, excess)):
            kernel = self._ready.popleft()
            task = asyncio.create_task(kernel.close(why="the pool shrank"))
            self._shrinking.add(task)
            task.add_done_callback(self._shrinking.discard)
        if excess > 0:
            log.info("pool shrank profile=%s ready=%d", self.profile.name, len(self._ready))

    async def _add_one(self) -> None:
        try:
            async with self._starts:
                await self._no_misses.wait()
                if self._closed:
                    return
                try:
                    kernel = await self._start_with_retries()
                except SandboxStartError as exc:
                    log.error("pool refill failed: %s", exc)
                    await asyncio.sleep(1.0)  # don't spin on a broken machine
                    self._wanted.set()
                    return
            if self._closed:
                await kernel.close()
            else:
                self._ready.append(kernel)
                self._added.set()
        finally:
            self._starting -= 1

    async def close(self) -> None:
        """Stop refilling and close every pooled kernel."""
        self._closed = True
        if self._refill_timer is not None:
            self._refill_timer.cancel()
        self._wanted.set()
        if self._refill_task is not None:
            self._refill_task.cancel()
            await asyncio.gather(self._refill_task, return_exceptions=True)
        kernels = list(self._ready)
        self._ready.clear()
        await asyncio.gather(
            *(k.close() for k in kernels), *self._shrinking, return_exceptions=True
        )
