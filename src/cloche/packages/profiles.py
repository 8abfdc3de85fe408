"""Profiles from a file (`--profiles PATH`): runtimes built on the host from requirements.

    [profiles.ml]
    requirements = ["scikit-learn>=1.5", "polars"]   # pip requirement strings
    preload = ["sklearn", "polars"]                  # imported in pooled sandboxes before use
    pool = 1                                          # warm sandboxes kept ready
    memory_mib = 1024                                 # optional, within the server's limit
    egress = "research"                               # optional: the sessions' egress policy

Each profile's runtime is a site-packages directory built in the background from wheels
only (through the shared wheel cache), mounted read-only into its sandboxes instead of the
server's runtime. It is stored by the hash of its resolved wheels, so that two profiles
with the same requirements share one, and a link from the hash of the requirements as
written lets a restart find it without asking the index again. A profile with an error
(an unknown key, a bad requirement, one that doesn't resolve) is reported by name with
its cause; the others serve.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloche.config import MIB
from cloche.errors import ConfigError, PackageInstallError
from cloche.packages import requirements, unpack
from cloche.packages.cache import WheelCache
from cloche.packages.resolver import Pip
from cloche.sandbox.files import WorkdirFiles

log = logging.getLogger("cloche.packages")

KEYS = ("requirements", "preload", "pool", "memory_mib", "egress")
BUILT_IN = ("lean", "data")
MAX_POOL = 16
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_MAX_RUNTIME_FILE_BYTES = 1024 * MIB


@dataclass(frozen=True)
class ProfileSpec:
    """A profile as the file describes it."""

    name: str
    requirements: tuple[str, ...]
    preload: tuple[str, ...] = ()
    pool: int = 1
    memory_mib: int | None = None
    egress: str | None = None  # the policy its sessions get when they ask for none

    @property
    def preload_code(self) -> str:
        return "".join(f"import {module}\n" for module in self.preload)


class ProfileState(enum.Enum):
    """Where a profile from the file is."""

    BUILDING = "building"  # its runtime is being resolved, fetched and unpacked
    READY = "ready"  # its runtime is built; its pool serves sessions
    FAILED = "failed"  # it can't serve: `error` says why


@dataclass
class ProfileStatus:
    """A profile's state, and what its runtime holds once built."""

    name: str
    state: ProfileState
    error: str | None = None
    packages: list[dict[str, str]] = field(default_factory=list)
    spec: ProfileSpec | None = None
    runtime_dir: Path | None = None
    build_s: float | None = None  # seconds its runtime took to build (or to be found)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set when no longer building


def load(path: Path, max_memory_mib: int) -> tuple[list[ProfileSpec], dict[str, str]]:
    """The file's profiles, and an error for each profile refused (name -> message).

    Raises:
        ConfigError: the file can't be read, or is not TOML with a [profiles] table.
    """
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--profiles {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--profiles {path}: not valid TOML ({exc})") from None
    extra = sorted(set(data) - {"profiles"})
    if extra or not isinstance(data.get("profiles"), dict):
        raise ConfigError(
            f"--profiles {path}: expected only [profiles.NAME] tables"
            + (f", not {', '.join(extra)}" if extra else "")
        )
    specs: list[ProfileSpec] = []
    errors: dict[str, str] = {}
    for name, table in data["profiles"].items():
        try:
            specs.append(_spec(name, table, max_memory_mib))
        except ValueError as exc:
            errors[name] = f"profile {name!r} in {path}: {exc}"
            log.error("%s", errors[name])
    return specs, errors


def _spec(name: str, table: Any, max_memory_mib: int) -> ProfileSpec:
    if not _NAME.match(name):
        raise ValueError("a profile's name is 1-32 of a-z, 0-9, - and _")
    if name in BUILT_IN:
        raise ValueError(f"{name} is a built-in profile")
    if not isinstance(table, dict):
        raise ValueError("expected a table")
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown key {', '.join(unknown)} (known: {', '.join(KEYS)})")
    specs = table.get("requirements")
    if not isinstance(specs, list) or not specs or not all(isinstance(s, str) for s in specs):
        raise ValueError("requirements must be a non-empty list of pip requirement strings")
    try:
        requirements.parse(specs)
    except PackageInstallError as exc:
        raise ValueError(str(exc)) from None
    preload = table.get("preload", [])
    if not isinstance(preload, list) or not all(
        isinstance(m, str) and _MODULE.match(m) for m in preload
    ):
        raise ValueError("preload must be a list of module names")
    pool = table.get("pool", 1)
    if type(pool) is not int or not 0 <= pool <= MAX_POOL:
        raise ValueError(f"pool must be a whole number from 0 to {MAX_POOL}")
    memory = table.get("memory_mib")
    if memory is not None and (type(memory) is not int or not 0 < memory <= max_memory_mib):
        raise ValueError(
            f"memory_mib must be from 1 to the server's {max_memory_mib} (--memory-mib)"
        )
    egress = table.get("egress")
    if egress is not None and (not isinstance(egress, str) or not egress):
        raise ValueError("egress must be the name of a policy of --egress-policy")
    return ProfileSpec(name, tuple(specs), tuple(preload), pool, memory, egress)


class RuntimeBuilder:
    """Builds runtimes from requirements under root, and finds those already built."""

    def __init__(self, pip: Pip, cache: WheelCache, root: Path) -> None:
        self.pip = pip
        self.cache = cache
        self.root = root

    async def build(self, spec: ProfileSpec) -> tuple[Path, list[dict[str, str]]]:
        """(runtime dir, [{name, version}]) for the profile. Raises PackageInstallError."""
        asked = _digest(sorted(spec.requirements))
        link = self.root / "requested" / asked
        found = await asyncio.to_thread(self._built, link)
        if found is not None:
            return found
        wheels = await self.pip.resolve(list(spec.requirements), {})
        resolved = _digest(sorted(f"{w.name}=={w.version} {w.sha256}" for w in wheels))
        target = self.root / "built" / resolved
        if not (target / "packages.json").is_file():
            files = await self.cache.fetch(self.pip, wheels)
            manifest = [{"name": w.name, "version": w.version} for w in wheels]
            await asyncio.to_thread(self._unpack, target, [files[w] for w in wheels], manifest)
        await asyncio.to_thread(self._link, link, resolved)
        found = await asyncio.to_thread(self._built, link)
        assert found is not None
        return found

    def _built(self, link: Path) -> tuple[Path, list[dict[str, str]]] | None:
        try:
            target = self.root / "built" / link.read_text().strip()
            packages = json.loads((target / "packages.json").read_text())
        except (OSError, ValueError):
            return None
        return target / "site-packages", packages

    def _unpack(self, target: Path, wheels: list[Path], manifest: list[dict[str, str]]) -> None:
        staging = target.parent / f".{target.name}.{secrets.token_hex(4)}"
        try:
            (staging / "site-packages").mkdir(parents=True)
            # Read by the sandbox's user through a read-only mount (files: WorkdirFiles' 0o644).
            for directory in (staging, staging / "site-packages"):
                directory.chmod(0o755)  # noqa: S103
            site = WorkdirFiles(staging / "site-packages", None, None, _MAX_RUNTIME_FILE_BYTES)
            for wheel in wheels:
                unpack.unpack(wheel, site)
            (staging / "packages.json").write_text(json.dumps(manifest))
            try:
                staging.rename(target)
            except OSError:
                if not (target / "packages.json").is_file():  # not a twin's finished build
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _link(self, link: Path, resolved: str) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        temp = link.with_name(f".{link.name}.{secrets.token_hex(4)}")
        temp.write_text(resolved)
        temp.replace(link)


def _digest(lines: list[str]) -> str:
    """A hash of lines, for this interpreter and platform (wheels differ between them)."""
    tag = f"{sys.implementation.cache_tag} {sys.platform} {os.uname().machine}"
    return hashlib.sha256("\n".join([tag, *lines]).encode()).hexdigest()[:32]


class ProfileCatalog:
    """The profiles of the file: built one at a time in the background.

    Args:
        specs: The profiles the file describes.
        errors: Those it refused (name -> message): listed as failed.
        builder: Builds their runtimes.
        on_ready: Called with each profile once its runtime is built (its pool starts).
    """

    def __init__(
        self,
        specs: list[ProfileSpec],
        errors: dict[str, str],
        builder: RuntimeBuilder,
        on_ready: Callable[[ProfileStatus], None],
    ) -> None:
        self.builder = builder
        self.on_ready = on_ready
        self.statuses: dict[str, ProfileStatus] = {}
        for name, error in errors.items():
            self.statuses[name] = ProfileStatus(name, ProfileState.FAILED, error)
            self.statuses[name].ready.set()
        for spec in specs:
            self.statuses[spec.name] = ProfileStatus(spec.name, ProfileState.BUILDING, spec=spec)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._build_all(), name="cloche-profiles")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _build_all(self) -> None:
        for status in list(self.statuses.values()):
            if status.spec is not None and status.state is ProfileState.BUILDING:
                await self._build(status, status.spec)

    async def _build(self, status: ProfileStatus, spec: ProfileSpec) -> None:
        started = asyncio.get_running_loop().time()
        try:
            await asyncio.to_thread(self.builder.cache.prepare)
            await asyncio.to_thread(self.builder.pip.prepare)  # also with --packages off
            runtime, packages = await self.builder.build(spec)
        except (PackageInstallError, OSError) as exc:
            status.state = ProfileState.FAILED
            status.error = f"profile {spec.name!r}: {exc}"
            log.error("%s", status.error)
        except Exception as exc:  # a fault of ours: the profile fails, the others still build
            status.state = ProfileState.FAILED
            status.error = f"profile {spec.name!r}: the build failed inside the server ({exc!r})"
            log.exception("%s", status.error)
        else:
            status.runtime_dir, status.packages = runtime, packages
            status.build_s = asyncio.get_running_loop().time() - started
            status.state = ProfileState.READY
            log.info(
                "profile ready name=%s build_s=%.2f runtime=%s", spec.name, status.build_s, runtime
            )
            self.on_ready(status)
        finally:
            status.ready.set()

    async def wait(self, name: str, timeout_s: float) -> ProfileStatus | None:
        """The profile once it is no longer building (None if the file has none of that
        name). Raises TimeoutError while it still builds after timeout_s."""
        status = self.statuses.get(name)
        if status is None:
            return None
        async with asyncio.timeout(timeout_s):
            await status.ready.wait()
        return status


def file_profiles(
    path: Path,
    max_memory_mib: int,
    installer_pip: Pip,
    cache: WheelCache,
    on_ready: Callable[[ProfileStatus], None],
) -> ProfileCatalog:
    """The catalog of the profile file at path; runtimes go under the cache's directory.

    Raises:
        ConfigError: the file is unreadable or not a TOML file of profiles.
    """
    specs, errors = load(path, max_memory_mib)
    pip = Pip(
        installer_pip.python,
        None,  # a profile's runtime is its own: nothing counts as installed
        installer_pip.tool_dir,
        installer_pip.index_url,
        installer_pip.timeout_s,
    )
    return ProfileCatalog(
        specs, errors, RuntimeBuilder(pip, cache, cache.root / "runtimes"), on_ready
    )


def runtime_packages(runtime_dir: Path | None) -> list[dict[str, str]]:
    """[{name, version}] of the distributions in a site-packages (blocking)."""
    if runtime_dir is None or not runtime_dir.is_dir():
        return []
    found = []
    for entry in sorted(os.listdir(runtime_dir)):
        if entry.endswith(".dist-info") and "-" in entry:
            name, version = entry[: -len(".dist-info")].split("-", 1)
            found.append({"name": name.replace("_", "-").lower(), "version": version})
    return found


def describe(catalog: ProfileCatalog | None, runtime_dir: Path | None) -> list[dict[str, Any]]:
    """Every profile, built-in and from the file: name, state, error, packages (blocking)."""
    default = runtime_packages(runtime_dir)
    rows: list[dict[str, Any]] = [
        {"name": name, "state": "ready", "error": None, "packages": default, "built_in": True}
        for name in BUILT_IN
    ]
    for status in catalog.statuses.values() if catalog is not None else ():
        rows.append(
            {
                "name": status.name,
                "state": status.state.value,
                "error": status.error,
                "packages": status.packages,
                "built_in": False,
            }
        )
    return rows
