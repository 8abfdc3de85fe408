"""The local Docker engine, through its CLI (`docker`): every call cloche makes to it is here.

A template from an image of the engine is saved out of it (`docker save`) and unpacked as an
archive; one from a Dockerfile is built by it (`docker build`) under a temporary tag first,
removed afterwards whatever happened. The engine is found as the `docker` CLI finds it
(DOCKER_HOST, or its socket).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from cloche.errors import TemplateFailed
from cloche.sandbox.image_tools import Progress, run

log = logging.getLogger("cloche.templates")

_STEP = re.compile(r"^Step (\d+)/(\d+) :")


async def save(image: str, archive: Path, progress: Progress) -> None:
    """`docker save` of an image of the engine (NAME:TAG, a name checked by the caller) into
    archive, a docker-archive.

    Raises:
        TemplateFailed: the engine has no such image, or can't be reached (its own words).
    """
    await run(["docker", "save", "--output", str(archive), image], progress, "docker save")


async def build(dockerfile: Path, context: Path, tag: str, progress: Progress) -> None:
    """`docker build` of a Dockerfile with its context (absolute paths) into an image tagged
    tag; the build's own lines go into the log, its steps into the progress.

    Raises:
        TemplateFailed: the build failed (docker's last line says where).
    """

    def said(text: str) -> None:
        progress.line(text)
        step = _STEP.match(text)
        if step is not None:
            progress.update(step=int(step.group(1)), steps=int(step.group(2)))

    argv = ["docker", "build", "--file", str(dockerfile), "--tag", tag, "--force-rm"]
    await run([*argv, str(context)], progress, "docker build", on_stdout=said)


async def remove(tag: str, progress: Progress) -> None:
    """Remove an image cloche tagged for a build (and its untagged parents); a failure is
    logged, never raised: the build's own outcome is what counts."""
    try:
        await run(["docker", "image", "rm", "--force", tag], progress, "docker image rm")
    except TemplateFailed as exc:
        if "No such image" not in str(exc):
            log.warning("the build's image %s could not be removed: %s", tag, exc)
