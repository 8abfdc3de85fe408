"""Templates from images: a root filesystem unpacked from a source, and what a sandbox needs
to know of it (`TemplateInfo`, kept as template.json beside it)::

    <templates_dir>/<name>/template.json   the record: state, source, env, shell, python, user
    <templates_dir>/<name>/rootfs/         the root filesystem, never written after its build
    <templates_dir>/.build-<name>-<hex>/   a build under way (gone when it ends)

Sources, with REF in the containers-transports syntax:

- a root filesystem tarball (`docker export`, mmdebstrap): laid out by cloche's chrooted
  helper (`sandbox/rootfs.py`), which refuses member names and hardlink targets that lead out;
- `docker-archive:PATH`, `oci-archive:PATH` or `oci:DIR[:TAG]`: copied by skopeo into an OCI
  layout of the build's own, its layers (whiteouts and all) applied by `umoci raw unpack`;
- `docker-daemon:NAME:TAG` (or a bare `NAME:TAG`) and a Dockerfile: through the local Docker
  engine (`sandbox/docker_engine.py`, the one module that calls it), then as an archive.

The helper then finishes the root (the user `user`, /home/user, /work, no device nodes) and
finds its shell and python3 by their names: nothing of the image runs on the host.
"""

from __future__ import annotations

import asyncio
import datetime
import enum
import json
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cloche.errors import TemplateFailed
from cloche.sandbox import docker_engine, image_tools
from cloche.sandbox.image_tools import Progress

__all__ = [
    "DEFAULT_PATH",
    "TemplateInfo",
    "TemplateSource",
    "TemplateState",
    "build",
    "check_source",
]

DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RECORD = "template.json"
ROOTFS = "rootfs"
LOG_LINES = 50  # the builder's last lines kept in a record
OCI_TAG = "cloche"  # the tag of the image in a build's own OCI layout
_FILE_TRANSPORTS = ("docker-archive", "oci-archive")
_TRANSPORTS = (*_FILE_TRANSPORTS, "oci", "docker-daemon")
# What `docker` accepts as an image reference (no leading '-': never taken for an option).
_DOCKER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$")
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
SourceKind = Literal["tar", "image", "dockerfile"]


class TemplateState(enum.Enum):
    """Where a template is."""

    BUILDING = "building"  # its source is being unpacked; no session may use it yet
    READY = "ready"  # its rootfs is in place, read-only from now on
    FAILED = "failed"  # its build failed or was cut short: `error` and `log` say why


@dataclass(frozen=True)
class TemplateSource:
    """What a template is built from.

    Attributes:
        kind: "tar" (a root filesystem tarball), "image" (a REF), "dockerfile".
        ref: the tarball's or the Dockerfile's path on the server, or the image's REF.
        context: a Dockerfile's build context (default: the Dockerfile's directory).
    """

    kind: SourceKind
    ref: str
    context: str | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": self.kind, "ref": self.ref}
        if self.context is not None:
            body["context"] = self.context
        return body


def now() -> str:
    """The time now, as a record says it (ISO 8601, UTC, to the second)."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


@dataclass
class TemplateInfo:
    """A template's record (template.json). A sandbox reads `env`, `shell`, `python` and
    `user` from it; `working_dir` and `image_user` are the image's own, for information."""

    name: str
    state: TemplateState
    source: dict[str, Any]  # {"kind", "ref"[, "context"]}; kind "builtin" for `python`
    error: str | None = None
    log: list[str] = field(default_factory=list)  # the builder's last lines
    progress: dict[str, Any] = field(default_factory=dict)  # {"phase", ...} while building
    env: list[str] = field(default_factory=lambda: [DEFAULT_PATH])  # "K=V"
    shell: str | None = None  # /bin/bash, else /bin/sh; None: the image has neither
    python: str | None = None  # the image's python3 (>= 3.9), e.g. /usr/bin/python3.11
    python_version: str | None = None  # its X.Y
    user: dict[str, Any] = field(default_factory=dict)  # {"name", "uid", "gid", "home"}
    size_bytes: int = 0  # of the rootfs on disk
    created_at: str = field(default_factory=now)  # ISO 8601, UTC
    working_dir: str | None = None  # the image config's WorkingDir
    image_user: str | None = None  # the image config's User (cells run as `user` anyway)
    built_in: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state.value,
            "error": self.error,
            "log": list(self.log),
            "progress": dict(self.progress),
            "source": dict(self.source),
            "env": list(self.env),
            "shell": self.shell,
            "python": self.python,
            "python_version": self.python_version,
            "user": dict(self.user) or None,
            "size_bytes": self.size_bytes,
            "created_at": self.created_at,
            "working_dir": self.working_dir,
            "image_user": self.image_user,
            "built_in": self.built_in,
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> TemplateInfo:
        """Raises ValueError (or KeyError, TypeError) for a record of another shape."""
        return cls(
            name=str(body["name"]),
            state=TemplateState(body["state"]),
            source=dict(body["source"]),
            error=body.get("error"),
            log=[str(line) for line in body.get("log", [])],
            progress=dict(body.get("progress") or {}),
            env=[str(pair) for pair in body.get("env", [DEFAULT_PATH])],
            shell=body.get("shell"),
            python=body.get("python"),
            python_version=body.get("python_version"),
            user=dict(body.get("user") or {}),
            size_bytes=int(body.get("size_bytes", 0)),
            created_at=str(body.get("created_at") or now()),
            working_dir=body.get("working_dir"),
            image_user=body.get("image_user"),
            built_in=bool(body.get("built_in", False)),
        )

    def fail(self, error: str) -> None:
        self.state = TemplateState.FAILED
        self.error = error
        self.progress = {}


class _Live(Progress):
    """A build's progress and lines, straight into its record (read by the API meanwhile)."""

    def __init__(self, info: TemplateInfo) -> None:
        self.info = info

    def line(self, text: str) -> None:
        self.info.log.append(text)
        del self.info.log[:-LOG_LINES]

    def update(self, **progress: Any) -> None:
        if "phase" in progress:  # a new phase: the last one's figures are done with
            self.info.progress = {}
        self.info.progress.update(progress)


def check_source(source: TemplateSource) -> None:
    """Refuse, at once, a source that can't be built: a path that is not absolute or not
    there, a transport not offered, a name the Docker engine would not take.

    Raises:
        ValueError: naming what is wrong.
    """
    if source.kind == "tar":
        _check_path(source.ref, "from_tar", file=True)
    elif source.kind == "dockerfile":
        _check_path(source.ref, "dockerfile", file=True)
        if source.context is not None:
            _check_path(source.context, "context", file=False)
    elif source.kind == "image":
        transport, rest = parse_ref(source.ref)
        if transport in _FILE_TRANSPORTS:
            _check_path(rest, f"from_image {transport}:", file=True)
        elif transport == "oci":
            _check_path(rest.split(":", 1)[0], "from_image oci:", file=False)
    else:
        raise ValueError(f"unknown source kind {source.kind!r} (tar, image or dockerfile)")


def _check_path(path: str, what: str, *, file: bool) -> None:
    if not os.path.isabs(path):
        raise ValueError(f"{what} {path!r}: a path on the server must be absolute")
    if file and not os.path.isfile(path):
        raise ValueError(f"{what} {path!r}: no such file on the server")
    if not file and not os.path.isdir(path):
        raise ValueError(f"{what} {path!r}: no such directory on the server")


def parse_ref(ref: str) -> tuple[str, str]:
    """(transport, the rest) of an image REF; a bare `NAME:TAG` is the Docker engine's.

    Raises:
        ValueError: a transport not offered here, or a name the engine would not take.
    """
    transport, sep, rest = ref.partition(":")
    if sep and transport in _TRANSPORTS:
        if transport == "docker-daemon" and not _DOCKER_NAME.match(rest):
            raise ValueError(f"from_image {ref!r}: not an image name of the Docker engine")
        if not rest:
            raise ValueError(f"from_image {ref!r}: the transport needs a path or a name")
        return transport, rest
    if sep and transport in ("docker", "containers-storage", "dir", "ostree", "sif"):
        raise ValueError(
            f"from_image {ref!r}: the {transport}: transport is not offered; build from "
            "docker-archive:PATH, oci-archive:PATH, oci:DIR[:TAG] or an image of the local "
            "Docker engine (docker-daemon:NAME:TAG, or NAME:TAG: `docker pull` it there first)"
        )
    if not _DOCKER_NAME.match(ref):
        raise ValueError(f"from_image {ref!r}: not a REF (docker-archive:PATH, NAME:TAG, ...)")
    return "docker-daemon", ref


async def build(source: TemplateSource, work: Path, info: TemplateInfo) -> Path:
    """Unpack source into work/rootfs and finish it, filling info's env, shell, python,
    user and size as found; progress and the builder's lines go into info meanwhile.
    work is the build's own directory (made here); the caller removes it afterwards.

    Returns:
        The finished rootfs (work/rootfs), to be renamed into place.

    Raises:
        TemplateFailed: a tool failed or refused (its own lines are in info.log).
        asyncio.CancelledError: the build was cut short; its processes are killed.
    """
    live = _Live(info)
    await asyncio.to_thread(work.mkdir, mode=0o700)
    rootfs = work / ROOTFS
    if source.kind == "tar":
        await asyncio.to_thread(rootfs.mkdir, mode=0o755)
        live.update(phase="extracting")
        await image_tools.helper(live, "extract", source.ref, str(rootfs))
    else:
        config = await _unpack_image(source, work, rootfs, live)
        info.env = _env(config.get("Env"))
        info.working_dir = config.get("WorkingDir") or None
        info.image_user = config.get("User") or None
    live.update(phase="finishing")
    found = await image_tools.helper(live, "finish", str(rootfs))
    info.shell = found.get("shell")
    info.python = found.get("python")
    info.python_version = found.get("python_version")
    info.user = dict(found.get("user") or {})
    info.size_bytes = int(found.get("size_bytes", 0))
    return rootfs


async def _unpack_image(
    source: TemplateSource, work: Path, rootfs: Path, live: _Live
) -> dict[str, Any]:
    """An image source, unpacked into rootfs; its OCI config's `config` object."""
    if source.kind == "dockerfile":
        tag = f"cloche-template-build:{secrets.token_hex(6)}"
        dockerfile = Path(source.ref)
        context = Path(source.context) if source.context else dockerfile.parent
        live.update(phase="building")
        try:
            await docker_engine.build(dockerfile, context, tag, live)
            ref = await _saved(tag, work, live)
        finally:
            await docker_engine.remove(tag, live)
    else:
        transport, rest = parse_ref(source.ref)
        ref = await _saved(rest, work, live) if transport == "docker-daemon" else source.ref
    layout = work / "oci"
    live.update(phase="copying")
    await image_tools.skopeo_copy(ref, f"oci:{layout}:{OCI_TAG}", work, live)
    live.update(phase="unpacking")
    await image_tools.umoci_unpack(f"{layout}:{OCI_TAG}", rootfs, live)
    return await asyncio.to_thread(_oci_config, layout)


async def _saved(image: str, work: Path, live: _Live) -> str:
    """An image of the Docker engine, saved into work: its docker-archive REF."""
    archive = work / "image.tar"
    live.update(phase="saving")
    await docker_engine.save(image, archive, live)
    return f"docker-archive:{archive}"


def _blob(layout: Path, digest: Any) -> dict[str, Any]:
    """A JSON blob of an OCI layout, by digest (checked: it names a file of blobs/sha256)."""
    found = _DIGEST.match(str(digest))
    if found is None:
        raise TemplateFailed(f"the OCI layout names a blob {digest!r} that is not sha256")
    path = layout / "blobs" / "sha256" / found.group(1)
    if path.stat().st_size > 4 * 1024 * 1024:
        raise TemplateFailed(f"the OCI layout's blob {digest} is too large for JSON")
    body: dict[str, Any] = json.loads(path.read_text())
    return body


def _oci_config(layout: Path) -> dict[str, Any]:
    """The image config's `config` object ({"Env", "WorkingDir", "User", ...}) of the
    image tagged OCI_TAG in the build's OCI layout."""
    try:
        index = json.loads((layout / "index.json").read_text())
        for entry in index.get("manifests", []):
            if entry.get("annotations", {}).get("org.opencontainers.image.ref.name") == OCI_TAG:
                manifest = _blob(layout, entry["digest"])
                config = _blob(layout, manifest["config"]["digest"]).get("config") or {}
                return dict(config)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TemplateFailed(f"the image's OCI config can't be read: {exc}") from exc
    raise TemplateFailed(f"the OCI layout skopeo made has no image tagged {OCI_TAG}")


def _env(pairs: Any) -> list[str]:
    """The image's Env ("K=V" strings), with a default PATH when it sets none."""
    env = [str(p) for p in pairs or [] if isinstance(p, str) and "=" in p]
    if not any(p.startswith("PATH=") for p in env):
        env.insert(0, DEFAULT_PATH)
    return env
