"""The catalogue of templates: the built-in `python` (today's runtime: the host's /usr with
cloche's interpreter) and every template built under --templates-dir, found again at start.

A build runs in the background, one per name at a time and BUILDS_AT_ONCE at once; its record
says `building` meanwhile, with progress, then `ready`, or `failed` with the builder's own
lines. A build a crash interrupted is `failed` at the next start; a failed one leaves nothing
but its record. A template that live or paused sessions use can't be deleted: the manager
says which are used through `in_use`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import AsyncIterable, Callable
from pathlib import Path
from typing import BinaryIO

from cloche.config import MIB
from cloche.errors import (
    ConfigError,
    TemplateExists,
    TemplateFailed,
    TemplateInUse,
    TemplateNotFound,
    TemplateNotReady,
    TemplateRefused,
)
from cloche.sandbox import images
from cloche.sandbox.bundle import HOME, USER_GID, USER_UID
from cloche.sandbox.images import (
    DEFAULT_PATH,
    RECORD,
    ROOTFS,
    TemplateInfo,
    TemplateSource,
    TemplateState,
)
from cloche.sandbox.layers import System

__all__ = ["BUILT_IN", "Templates", "python_template"]

log = logging.getLogger("cloche.templates")

BUILT_IN = "python"
BUILDS_AT_ONCE = 2  # unpacking is disk- and CPU-bound: two at once on a small machine
UPLOADS = ".uploads"  # bodies of builds being received
_LEFTOVERS = (".build-", ".delete-", ".new-")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")  # as profiles' names
_UPLOAD_FLUSH_BYTES = 1 << 20
_STARTED_AT = images.now()


def python_template() -> TemplateInfo:
    """The built-in template: today's runtime, with no rootfs of its own."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return TemplateInfo(  # noqa: S604  # shell= is a field here, not a subprocess's
        name=BUILT_IN,
        state=TemplateState.READY,
        source={"kind": "builtin", "ref": "the host's /usr and cloche's interpreter"},
        env=[DEFAULT_PATH],
        shell="/bin/bash",
        python=sys.executable,
        python_version=version,
        user={"name": "user", "uid": USER_UID, "gid": USER_GID, "home": HOME},
        created_at=_STARTED_AT,
        built_in=True,
    )


class Templates:
    """The templates of this machine, under root (<templates_dir>/<name>/)."""

    def __init__(
        self,
        root: Path,
        in_use: Callable[[str], bool] | None = None,
        max_upload_bytes: int = 8192 * MIB,
    ) -> None:
        self.root = root
        self.in_use = in_use or (lambda name: False)
        self.max_upload_bytes = max_upload_bytes
        self._infos: dict[str, TemplateInfo] = {}
        self._builds: dict[str, asyncio.Task[None]] = {}
        self._busy: dict[str, str] = {}  # names being received or deleted -> which
        self._slots = asyncio.Semaphore(BUILDS_AT_ONCE)

    # -- start and stop -------------------------------------------------------------------

    async def open(self) -> None:
        """Find the templates built before (blocking work off the loop).

        Raises:
            ConfigError: the templates directory can't be made or read.
        """
        try:
            found = await asyncio.to_thread(self._load)
        except OSError as exc:
            raise ConfigError(f"--templates-dir {self.root}: {exc.strerror or exc}") from exc
        for info in found:
            self._infos[info.name] = info

    def _load(self) -> list[TemplateInfo]:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # images hold setuid files: no host user may reach them
        found = []
        for entry in sorted(self.root.iterdir()):
            if entry.name == UPLOADS or entry.name.startswith(_LEFTOVERS):
                shutil.rmtree(entry, ignore_errors=True)  # of a server that stopped mid-way
            elif entry.is_dir() and _NAME.match(entry.name) and entry.name != BUILT_IN:
                found.append(self._read(entry))
            else:
                log.warning("templates dir %s: %s is not a template; left alone", self.root, entry)
        log.info("templates dir %s: %d templates", self.root, len(found))
        return found

    def _read(self, directory: Path) -> TemplateInfo:
        """A template's record; one that was building when its server stopped is failed."""
        try:
            info = TemplateInfo.from_json(json.loads((directory / RECORD).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            info = TemplateInfo(directory.name, TemplateState.FAILED, {"kind": "?", "ref": ""})
            info.fail(f"its record {directory / RECORD} can't be read: {exc}")
        info.name = directory.name
        if info.state is TemplateState.BUILDING:
            info.fail("interrupted: the server stopped while it was being built; build it again")
        elif info.state is TemplateState.READY and not (directory / ROOTFS).is_dir():
            info.fail(f"its rootfs {directory / ROOTFS} is missing; build it again")
        if info.state is TemplateState.FAILED:
            shutil.rmtree(directory / ROOTFS, ignore_errors=True)
            _write_record(directory, json.dumps(info.to_json()))
        return info

    async def close(self) -> None:
        """Stop the builds under way (each is recorded failed)."""
        for task in self._builds.values():
            task.cancel()
        await asyncio.gather(*self._builds.values(), return_exceptions=True)

    # -- reading --------------------------------------------------------------------------

    def list(self) -> list[TemplateInfo]:
        """The built-in `python`, then every template here by name."""
        return [python_template(), *(self._infos[n] for n in sorted(self._infos))]

    def get(self, name: str) -> TemplateInfo:
        """Raises TemplateNotFound."""
        if name == BUILT_IN:
            return python_template()
        info = self._infos.get(name)
        if info is None:
            raise TemplateNotFound(name)
        return info

    def ready(self, name: str) -> tuple[Path | None, TemplateInfo]:
        """A template sessions can start from: its rootfs (None for the built-in `python`,
        whose system is the host's /usr) and its record.

        Raises:
            TemplateNotFound: no template of that name.
            TemplateNotReady: it is still being built.
            TemplateFailed: its build failed (the message says why).
        """
        info = self.get(name)
        if info.built_in:
            return None, info
        if info.state is TemplateState.BUILDING:
            raise TemplateNotReady(f"template {name} is still being built; try again when ready")
        if info.state is TemplateState.FAILED:
            raise TemplateFailed(f"template {name} failed to build: {info.error}")
        return self.root / name / ROOTFS, info

    def system(self, name: str) -> System:
        """What a ready template gives its sessions' sandboxes (`TemplateSystems`): its
        rootfs and defaults. The built-in `python`'s system is the backend's own.

        Raises:
            TemplateNotFound, TemplateNotReady, TemplateFailed: it can't serve.
            TemplateRefused: `python`, which has no rootfs here.
        """
        rootfs, info = self.ready(name)
        if rootfs is None:
            raise TemplateRefused(f"{name} is the built-in template: the backend's own system")
        user = info.user
        return System(
            name=name,
            rootfs=rootfs,
            env=tuple(info.env),
            shell_path=info.shell or "/bin/sh",
            python=info.python,
            user=str(user.get("name", "user")),
            uid=int(user.get("uid", USER_UID)),
            gid=int(user.get("gid", USER_GID)),
            home=str(user.get("home", HOME)),
        )

    # -- building and deleting ------------------------------------------------------------

    async def build(
        self,
        name: str,
        source: TemplateSource,
        upload: AsyncIterable[bytes] | None = None,
    ) -> TemplateInfo:
        """Start building a template; its record, at once, in state building. With upload,
        the source's file is those bytes (a tarball, or a docker-archive for kind "image"),
        received first, up to max_upload_bytes.

        Raises:
            TemplateRefused: a bad name, the built-in's, a source that is not there, an
                upload too large.
            TemplateExists: one of that name is ready, or being built or deleted.
        """
        self._check_name(name)
        if name in self._busy or name in self._builds:
            doing = self._busy.get(name, "built")
            raise TemplateExists(f"template {name} is being {doing}; wait for it to end")
        current = self._infos.get(name)
        if current is not None and current.state is TemplateState.READY:
            raise TemplateExists(
                f"template {name} exists; delete it first (`cloche templates delete {name}`)"
            )
        shown = source
        if upload is None:
            try:
                images.check_source(source)
            except ValueError as exc:
                raise TemplateRefused(str(exc)) from None
        self._busy[name] = "received"
        received: Path | None = None
        try:
            if upload is not None:
                received = await self._receive(upload)
                ref = f"docker-archive:{received}" if source.kind == "image" else str(received)
                source = TemplateSource(source.kind, ref)
            info = TemplateInfo(name, TemplateState.BUILDING, shown.to_json())
            info.progress = {"phase": "queued"}
            await asyncio.to_thread(self._prepare, name, json.dumps(info.to_json()))
        except BaseException:
            if received is not None:
                await asyncio.to_thread(received.unlink, missing_ok=True)
            raise
        finally:
            del self._busy[name]
        self._infos[name] = info
        task = asyncio.create_task(self._build(name, source, info, received))
        self._builds[name] = task
        return info

    def _check_name(self, name: str) -> None:
        if name == BUILT_IN:
            raise TemplateRefused(
                f"{BUILT_IN} is the built-in template (the host's runtime): it can't be built "
                "over or deleted; give the template another name"
            )
        if not isinstance(name, str) or not _NAME.match(name):
            raise TemplateRefused(
                f"template name {name!r}: a name is 1-32 of a-z, 0-9, - and _, starting with "
                "a letter or digit"
            )

    async def _receive(self, upload: AsyncIterable[bytes]) -> Path:
        """The upload's bytes in a file of UPLOADS, written a piece at a time off the loop."""
        directory = self.root / UPLOADS
        await asyncio.to_thread(directory.mkdir, mode=0o700, parents=True, exist_ok=True)
        path = directory / f"{secrets.token_hex(8)}.tar"
        out = await asyncio.to_thread(path.open, "xb")
        size = written = 0
        try:
            pending: list[bytes] = []
            async for chunk in upload:
                size += len(chunk)
                if size > self.max_upload_bytes:
                    raise TemplateRefused(
                        f"the upload is above {self.max_upload_bytes / MIB:g} MiB "
                        "(--template-max-mib)"
                    )
                pending.append(chunk)
                if size - written >= _UPLOAD_FLUSH_BYTES:
                    await asyncio.to_thread(out.write, b"".join(pending))
                    pending.clear()
                    written = size
            await asyncio.to_thread(out.write, b"".join(pending))
            if size == 0:
                raise TemplateRefused("the upload is empty: send the tarball as the body")
        except BaseException:
            await asyncio.to_thread(_discard, out, path)
            raise
        await asyncio.to_thread(out.close)
        return path

    def _prepare(self, name: str, record: str) -> None:
        """<root>/<name>/ holding only the record (an old failed one's directory replaced)."""
        directory = self.root / name
        if directory.exists():
            aside = self.root / f".delete-{name}-{secrets.token_hex(4)}"
            directory.rename(aside)
            shutil.rmtree(aside)
        directory.mkdir(mode=0o755)
        _write_record(directory, record)

    async def _build(
        self, name: str, source: TemplateSource, info: TemplateInfo, received: Path | None
    ) -> None:
        """Run a build to its end and record how it ended."""
        work = self.root / f".build-{name}-{secrets.token_hex(4)}"
        started = time.monotonic()
        failure: str | None = None
        try:
            async with self._slots:
                info.progress = {"phase": "starting"}
                rootfs = await images.build(source, work, info)
                await asyncio.to_thread(os.rename, rootfs, self.root / name / ROOTFS)
            log.info("template %s built in %.1f s", name, time.monotonic() - started)
        except asyncio.CancelledError:
            failure = "cancelled: the server stopped, or the template was deleted"
            raise
        except TemplateFailed as exc:
            failure = str(exc)
            log.warning("template %s failed: %s", name, exc)
        except Exception as exc:
            log.exception("template %s: the build broke", name)
            failure = f"the build broke: {type(exc).__name__}: {exc}"
        finally:
            await self._finish(name, info, work, received, failure, time.monotonic() - started)

    async def _finish(
        self,
        name: str,
        info: TemplateInfo,
        work: Path,
        received: Path | None,
        failure: str | None,
        took_s: float,
    ) -> None:
        """A build's leftovers removed and its record written (unless it is being deleted),
        to the end even when cancelled meanwhile; only then is its end seen (READY, or
        FAILED with why)."""

        def end(info: TemplateInfo) -> None:
            if failure is not None:
                info.fail(failure)
            else:
                info.state, info.error, info.progress = TemplateState.READY, None, {}
                info.log.append(f"built in {took_s:.1f} s")

        ended = copy.deepcopy(info)
        end(ended)
        record = None if self._busy.get(name) == "deleted" else json.dumps(ended.to_json())

        def clean() -> None:
            shutil.rmtree(work, ignore_errors=True)
            if received is not None:
                received.unlink(missing_ok=True)
            if record is not None:
                try:
                    _write_record(self.root / name, record)
                except OSError as exc:
                    log.error("template %s: its record can't be written: %s", name, exc)

        try:
            await _to_the_end(clean)
        finally:
            end(info)
            self._builds.pop(name, None)

    def check_deletable(self, name: str) -> None:
        """Raises what `delete` would before it changes anything (TemplateRefused,
        TemplateNotFound, TemplateInUse)."""
        if name == BUILT_IN:
            self._check_name(name)
        if name not in self._infos or name in self._busy:
            raise TemplateNotFound(name)
        if self.in_use(name):
            raise TemplateInUse(
                f"template {name} is used by live or paused sessions: close them first"
            )

    async def delete(self, name: str) -> None:
        """Delete a template and its rootfs (a build under way is stopped first).

        Raises:
            TemplateRefused: the built-in `python`.
            TemplateNotFound: no template of that name.
            TemplateInUse: live or paused sessions use it.
        """
        self.check_deletable(name)
        self._busy[name] = "deleted"
        try:
            task = self._builds.get(name)
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            del self._infos[name]
            aside = self.root / f".delete-{name}-{secrets.token_hex(4)}"
            await asyncio.to_thread(_remove, self.root / name, aside)
        finally:
            del self._busy[name]


def _write_record(directory: Path, record: str) -> None:
    """template.json, replaced whole (a reader never sees half of it)."""
    new = directory / f".{RECORD}.new"
    new.write_text(record)
    os.replace(new, directory / RECORD)


async def _to_the_end(function: Callable[..., None], *args: object) -> None:
    """function(*args) in a thread, waited for to its end even if cancelled meanwhile (the
    cancellation is raised afterwards)."""
    done = asyncio.ensure_future(asyncio.to_thread(function, *args))
    cancelled = False
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            cancelled = True
    done.result()
    if cancelled:
        raise asyncio.CancelledError


def _discard(out: BinaryIO, path: Path) -> None:
    out.close()
    path.unlink(missing_ok=True)


def _remove(directory: Path, aside: Path) -> None:
    """Rename the template's directory aside (its name is free at once), then remove it."""
    directory.rename(aside)
    shutil.rmtree(aside)  # never follows the image's symlinks
