"""The warm pools of a server's profiles: `lean` and `data` from the start, and each profile
of --profiles once its runtime is built (a session asked of one still building waits)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from cloche.config import ServerConfig
from cloche.errors import SandboxStartError, UnknownProfile
from cloche.packages.installer import Installer
from cloche.packages.profiles import ProfileCatalog, ProfileStatus, describe, file_profiles
from cloche.sandbox.base import Backend
from cloche.sandbox.layers import System
from cloche.sessions.observer import Observer
from cloche.sessions.pool import WarmPool
from cloche.sessions.profiles import DATA, LEAN, PYTHON, Profile, get_profile

PROFILE_WAIT_S = 30.0  # a new session of a profile still building waits this long, then 503


class ProfilePools:
    """A pool per profile, by name (`by_name`), and the --profiles catalog that builds the
    runtimes of the file's. llm_setup is the silent code every new sandbox runs."""

    def __init__(
        self,
        config: ServerConfig,
        backend: Backend,
        observer: Observer,
        installer: Installer,
        llm_setup: str,
        systems: Callable[[str], System] | None = None,
    ) -> None:
        self.config = config
        # The system of a template by name (raises for one that can't serve); None: the
        # server has the template python alone.
        self.systems = systems
        self.backend = backend
        self.observer = observer
        self._llm_setup = llm_setup
        self._stopped = False
        self.by_name = {
            profile.name: WarmPool(
                backend,
                config.limits,
                replace(
                    profile,
                    preload=profile.preload + llm_setup,
                    restored=profile.restored and config.data_template,
                ),
                size=size,
                max_frame_bytes=config.max_frame_bytes,
                start_concurrency=config.start_concurrency,
                max_size=config.pool_max,
            )
            for profile, size in ((LEAN, config.pool_size), (DATA, config.data_pool_size))
        }
        for pool in self.by_name.values():
            pool.on_start = self._started
        self.catalog: ProfileCatalog | None = None  # profiles from --profiles
        if config.profiles_file is not None:
            self.catalog = file_profiles(
                config.profiles_file,
                config.limits.memory_mib,
                installer.pip,
                installer.cache,
                self._ready,
            )

    @property
    def lean(self) -> WarmPool:
        return self.by_name[LEAN.name]

    def start(self) -> None:
        """Fill the pools, and build the file's profiles."""
        for pool in self.by_name.values():
            pool.start()
        if self.catalog is not None:
            self.catalog.start()

    async def stop_building(self) -> None:
        """No more profiles are built or pools started (shutdown's first step)."""
        self._stopped = True
        if self.catalog is not None:
            await self.catalog.stop()

    async def close(self) -> None:
        """Free every ready sandbox of every pool."""
        await asyncio.gather(*(pool.close() for pool in self.by_name.values()))

    async def wait_ready(self, name: str, timeout_s: float) -> None:
        if name in self.by_name:
            await self.by_name[name].wait_full(timeout_s)

    async def get(self, name: str, template: str = PYTHON) -> WarmPool:
        """The pool of a profile and template; a profile of the file waits while it builds
        (up to a limit); a template's pool is made at its first session.

        Raises:
            UnknownProfile: no such profile, or one whose build failed, or a template with a
                profile other than lean.
            TemplateNotFound, TemplateNotReady, TemplateFailed: the template can't serve.
            SandboxStartError: it is still building after PROFILE_WAIT_S.
        """
        if template != PYTHON:
            return self._template_pool(name, template)
        if name in self.by_name:
            return self.by_name[name]
        status = None
        if self.catalog is not None:
            try:
                status = await self.catalog.wait(name, PROFILE_WAIT_S)
            except TimeoutError:
                raise SandboxStartError(
                    f"profile {name!r} is still building its runtime; try again shortly "
                    "(GET /v1/profiles shows its state)"
                ) from None
        if status is not None and name not in self.by_name:
            raise UnknownProfile(status.error or f"profile {name!r} can't serve")
        return self.by_name.get(name) or self.by_name[get_profile(name).name]

    def _template_pool(self, name: str, template: str) -> WarmPool:
        if name != LEAN.name:
            raise UnknownProfile(
                f"profile {name!r} runs on the template python; a session of template "
                f"{template!r} is of profile lean"
            )
        if self.systems is None:
            raise UnknownProfile(f"no template {template!r} here: this server has python alone")
        system = self.systems(template)
        key = f"{name}@{template}"
        pool = self.by_name.get(key)
        if pool is not None and pool.profile.system == system:
            return pool
        if pool is not None:  # the template was built again: its old sandboxes go
            self.by_name.pop(key)
            asyncio.ensure_future(pool.close())
        profile = Profile(key, preload=self._llm_setup, system=system)
        pool = WarmPool(
            self.backend,
            self.config.limits,
            profile,
            size=self.config.pool_size,
            max_frame_bytes=self.config.max_frame_bytes,
            start_concurrency=self.config.start_concurrency,
            max_size=self.config.pool_max,
        )
        pool.on_start = self._started
        self.by_name[key] = pool
        if not self._stopped:
            pool.start()
        return pool

    async def drop_template(self, template: str) -> None:
        """Close the pool of a template (deleted)."""
        pool = self.by_name.pop(f"{LEAN.name}@{template}", None)
        if pool is not None:
            await pool.close()

    def describe(self) -> list[dict[str, Any]]:
        """Every profile with its state and packages (blocking: reads runtimes' listings)."""
        return describe(self.catalog, self.config.runtime_dir)

    def runtime_of(self, name: str) -> Path | None:
        """The runtime a profile's sandboxes mount instead of the server's, if any."""
        pool = self.by_name.get(name)
        return pool.profile.runtime_dir if pool is not None else None

    def _ready(self, status: ProfileStatus) -> None:
        """A profile of the file has its runtime: start its pool."""
        spec = status.spec
        assert spec is not None
        limits = self.config.limits
        if spec.memory_mib is not None:
            limits = replace(limits, memory_mib=spec.memory_mib)
        profile = Profile(
            spec.name, preload=spec.preload_code + self._llm_setup, runtime_dir=status.runtime_dir
        )
        pool = WarmPool(
            self.backend,
            limits,
            profile,
            size=spec.pool,
            max_frame_bytes=self.config.max_frame_bytes,
            start_concurrency=self.config.start_concurrency,
        )
        pool.on_start = self._started
        self.by_name[spec.name] = pool
        if not self._stopped:
            pool.start()

    def _started(self, profile: str, seconds: float, ok: bool) -> None:
        if ok:
            self.observer.sandbox_started(profile, seconds)
        else:
            self.observer.sandbox_start_failed(profile)
