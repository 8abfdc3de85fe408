"""Helpers of the template tests: a Debian root tarball by mmdebstrap, hostile tarballs made
with tarfile, and a build of a template waited for."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from cloche.sandbox import images
from cloche.sandbox.images import TemplateInfo, TemplateSource, TemplateState

MMDEBSTRAP_TIMEOUT_S = 900
# What mmdebstrap says when the Debian mirror can't be reached (then the tests skip).
_OFFLINE = (
    "Could not resolve",
    "Failed to fetch",
    "Temporary failure",
    "Connection refused",
    "Network is unreachable",
    "Could not connect",
    "Connection timed out",
)


IMAGE_MARKER = "/etc/cloche-test-image"  # a file only the test's images have, naming which
SETUID_ID = "/usr/local/bin/rootid"  # in the image without python3: a setuid-root copy of id


def make_debian_tar(path: Path, *, python: bool = True) -> Path:
    """`mmdebstrap --variant=minbase --include=python3,python3-yaml bookworm PATH`, with
    IMAGE_MARKER saying "debian"; without python (python=False) the minbase alone, marked
    "debian-without-python", with SETUID_ID in it."""
    if shutil.which("mmdebstrap") is None:
        pytest.fail("mmdebstrap is missing: scripts/install.sh --dev installs it")
    marker = "debian" if python else "debian-without-python"
    hooks = [f'echo {marker} > "$1"{IMAGE_MARKER}']
    if not python:
        hooks.append(f'cp "$1"/usr/bin/id "$1"{SETUID_ID} && chmod 4755 "$1"{SETUID_ID}')
    options = [f"--customize-hook={hook}" for hook in hooks]
    if python:
        options.append("--include=python3,python3-yaml")
    done = subprocess.run(
        [
            "mmdebstrap",
            "--variant=minbase",
            *options,
            "bookworm",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=MMDEBSTRAP_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        path.unlink(missing_ok=True)
        if any(sign in done.stderr for sign in _OFFLINE):
            pytest.skip(f"mmdebstrap can't reach the Debian mirror: {done.stderr[-500:]}")
        pytest.fail(f"mmdebstrap failed:\n{done.stderr[-3000:]}")
    return path


def member(
    name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", **attrs: object
) -> tuple[tarfile.TarInfo, bytes]:
    """A tar member: its header and its data."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    info.mtime = int(time.time())
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, data


def make_tar(path: Path, members: Iterable[tuple[tarfile.TarInfo, bytes]]) -> Path:
    """A tar of these members, in order (tarfile writes what it is told: `..`, `/x`, ...)."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def small_root(path: Path, *extra: tuple[tarfile.TarInfo, bytes]) -> Path:
    """A tiny root filesystem tarball (an /etc with root, a /bin/sh that is only a file),
    then extra members."""
    return make_tar(
        path,
        [
            member("./", tarfile.DIRTYPE),
            member("etc", tarfile.DIRTYPE),
            member("etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n"),
            member("etc/group", data=b"root:x:0:\n"),
            member("bin", tarfile.DIRTYPE),
            member("bin/sh", data=b"#!not really a shell\n", mode=0o755),
            *extra,
        ],
    )


def build(source: TemplateSource, work: Path, name: str = "t") -> tuple[TemplateInfo, Path | None]:
    """Run sandbox/images.build to its end: the record, and the rootfs (None if it failed)."""
    info = TemplateInfo(name, TemplateState.BUILDING, source.to_json())
    try:
        rootfs = asyncio.run(images.build(source, work, info))
    except images.TemplateFailed as exc:
        info.fail(str(exc))
        return info, None
    info.state = TemplateState.READY
    return info, rootfs


def tree(directory: Path) -> set[str]:
    """Every path under directory, relative (symlinks not followed)."""
    return {
        os.path.relpath(os.path.join(top, name), directory)
        for top, dirs, files in os.walk(directory)
        for name in dirs + files
    }
