"""Installing packages into a session: policy, resolution, the cache, the size limit, unpacking.

One `Installer` per server holds what sessions share (pip, the wheel cache, the policy);
each session's `SessionPackages` holds what it installed, and installs one batch at a time.
A refusal or a failure raises PackageInstallError before anything is written, except for
a failure while writing (the disk filled up), which may leave some files behind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cloche.config import MIB, PackageConfig
from cloche.errors import PackageInstallError
from cloche.packages import requirements, unpack
from cloche.packages.cache import WheelCache
from cloche.packages.resolver import Pip
from cloche.sandbox.base import Sandbox
from cloche.sandbox.files import WorkdirFiles

log = logging.getLogger("cloche.packages")

_DISK_SLACK_BYTES = 1 * MIB  # left free on a session's disk beyond the packages


class InstallObserver(Protocol):
    """Told about each install (the server's metrics, through `sessions.observer.Observer`)."""

    def package_install(
        self, outcome: str, seconds: float, downloaded: int, cached: int, written_bytes: int
    ) -> None: ...


@dataclass(frozen=True)
class Installed:
    """A package put into a session."""

    name: str
    version: str


@dataclass(frozen=True)
class InstallResult:
    """What an install did."""

    installed: list[Installed]  # new in the session's site directory
    satisfied: list[str]  # requested, and already there (the runtime's or installed before)
    pth: list[str]  # .pth files the new packages put at the top of the site directory


class Installer:
    """What every session's installs share."""

    def __init__(
        self,
        config: PackageConfig,
        python: str,
        runtime_dir: Path | None,
        observer: InstallObserver | None = None,
    ) -> None:
        self.config = config
        self.cache = WheelCache(config.cache_dir)
        self.pip = Pip(
            python, runtime_dir, config.cache_dir / "tool", config.index_url, config.timeout_s
        )
        self.observer = observer
        self._prepared = False

    def prepare(self) -> None:
        """Called as the server starts: nothing yet. The cache is made, and pip linked, at
        the first install (`setup`), so that a server that never installs writes nothing."""

    def setup(self) -> None:
        """Create the cache and link pip (blocking); once."""
        if not self._prepared:
            self.cache.prepare()
            self.pip.prepare()
            self._prepared = True

    def for_session(
        self, sandbox: Sandbox, runtime_dir: Path | None = None
    ) -> SessionPackages | None:
        """The installs of one session whose runtime is runtime_dir (by default the
        server's); None when its sandbox has no site directory."""
        if sandbox.site_dir is None:
            return None
        uid, gid = sandbox.file_owner or (None, None)
        site = WorkdirFiles(sandbox.site_dir, uid, gid, self.config.max_mib * MIB)
        return SessionPackages(self, site, runtime_dir)


class SessionPackages:
    """What one session installed, and its next install."""

    def __init__(
        self, installer: Installer, site: WorkdirFiles, runtime_dir: Path | None = None
    ) -> None:
        self.installer = installer
        self.site = site
        self.runtime_dir = runtime_dir
        self.installed: dict[str, str] = {}  # normalised name -> version
        self.used_bytes = 0
        self._lock = asyncio.Lock()

    async def install(self, specs: list[str]) -> InstallResult:
        """Install the requirements specs. Raises PackageInstallError."""
        async with self._lock:
            started = time.perf_counter()
            counts = [0, 0, 0]  # downloaded, from the cache, bytes written
            outcome = "error"
            try:
                result = await self._install(specs, counts)
                outcome = "ok"
                return result
            except PackageInstallError:
                outcome = "refused"
                raise
            finally:
                observer = self.installer.observer
                if observer is not None:
                    observer.package_install(outcome, time.perf_counter() - started, *counts)

    async def _install(self, specs: list[str], counts: list[int]) -> InstallResult:
        installer = self.installer
        config = installer.config
        if not config.enabled:
            raise PackageInstallError("this server does not install packages (--packages off)")
        wanted = requirements.parse(specs)
        await asyncio.to_thread(installer.setup)
        self._check_allowed({requirements.name_of(r) for r in wanted})
        wheels = await installer.pip.resolve(
            [str(r) for r in wanted], dict(self.installed), self.runtime_dir
        )
        self._check_allowed({wheel.name for wheel in wheels})
        new = []
        for wheel in wheels:
            have = self.installed.get(wheel.name)
            if have is None:
                new.append(wheel)
            elif have != wheel.version:
                raise PackageInstallError(
                    f"{wheel.name} {have} is installed in this session; {wheel.version} can't "
                    "replace it (a session's packages are only ever added to)"
                )
        counts[1] = sum(1 for wheel in new if installer.cache.has(wheel))
        files = await installer.cache.fetch(installer.pip, new)
        counts[0] = len(new) - counts[1]
        await asyncio.to_thread(self._check_room, [files[wheel] for wheel in new])
        pth: list[str] = []
        for wheel in new:
            written, wheel_pth = await asyncio.to_thread(unpack.unpack, files[wheel], self.site)
            counts[2] += written
            pth += wheel_pth
            self.installed[wheel.name] = wheel.version
        self.used_bytes += counts[2]
        chosen = {wheel.name for wheel in wheels}
        satisfied = [str(r) for r in wanted if requirements.name_of(r) not in chosen]
        log.info(
            "packages installed site=%s new=%s satisfied=%s bytes=%d",
            self.site.root,
            " ".join(f"{w.name}=={w.version}" for w in new) or "-",
            " ".join(satisfied) or "-",
            counts[2],
        )
        return InstallResult([Installed(w.name, w.version) for w in new], satisfied, pth)

    def _check_allowed(self, names: set[str]) -> None:
        allowed = self.installer.config.allow_list
        if allowed is None:
            return
        refused = sorted(names - allowed)
        if refused:
            raise PackageInstallError(
                "not on this server's allow-list (--packages allow-list:FILE): "
                + ", ".join(refused)
            )

    def _check_room(self, paths: list[Path]) -> None:
        """Refuse before writing: a bad entry, over --package-max-mib, or no room on disk."""
        total = 0
        for path in paths:
            try:
                with zipfile.ZipFile(path) as archive:
                    total += unpack.unpacked_bytes(unpack.plan(archive, path.name))
            except zipfile.BadZipFile as exc:
                raise PackageInstallError(f"{path.name} is not a valid wheel: {exc}") from exc
        limit = self.installer.config.max_mib * MIB
        if self.used_bytes + total > limit:
            raise PackageInstallError(
                f"installing would bring this session's packages to "
                f"{(self.used_bytes + total) / MIB:.1f} MiB, over the limit of "
                f"{self.installer.config.max_mib} MiB (--package-max-mib)"
            )
        disk = os.statvfs(self.site.root)
        free = disk.f_bavail * disk.f_frsize
        if total + _DISK_SLACK_BYTES > free:
            raise PackageInstallError(
                f"the packages need {total / MIB:.1f} MiB and the session's disk has "
                f"{free / MIB:.1f} MiB free (--disk-mib)"
            )
