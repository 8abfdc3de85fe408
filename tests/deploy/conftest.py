"""Docker for the image tests: the image, containers (the daemon: tests/dockerd.py)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dockerd import RUN_FLAGS, docker
from support import REPO, SANDBOX_START_TIMEOUT_S, slowness

IMAGE = "cloche:test"


def build_image(tag: str = IMAGE) -> None:
    """scripts/image.sh: the base image only when missing, then the (layer-cached) build.
    The image it replaces is removed, so that runs don't pile up images."""
    before = docker("image", "inspect", "--format", "{{.Id}}", tag, check=False)
    done = subprocess.run(
        [str(REPO / "scripts" / "image.sh"), tag],
        capture_output=True,
        text=True,
        timeout=1800 * slowness(),
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"scripts/image.sh failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    after = docker("image", "inspect", "--format", "{{.Id}}", tag)
    if before.startswith("sha256:") and before != after:
        docker("image", "rm", before, check=False)  # fails harmlessly while a container uses it


class Container:
    """One `docker run -d` of the image on free host ports, removed by remove(). Its waits
    are as on this project's machines, scaled by slowness() here; so is the server's
    --sandbox-start-timeout (CLOCHE_SANDBOX_START_TIMEOUT), unless env sets it."""

    def __init__(
        self,
        *flags: str,
        env: dict[str, str] | None = None,
        volume: str | None = None,
        image: str = IMAGE,
        command: tuple[str, ...] = (),
    ) -> None:
        self.name = f"cloche-test-{uuid.uuid4().hex[:8]}"
        self.volume = volume
        args = ["run", "-d", "--name", self.name, *flags]
        args += ["-p", "127.0.0.1::8000", "-p", "127.0.0.1::8080"]
        start_timeout = f"{SANDBOX_START_TIMEOUT_S * slowness():g}"
        env = {"CLOCHE_SANDBOX_START_TIMEOUT": start_timeout, **(env or {})}
        for key, value in env.items():
            args += ["-e", f"{key}={value}"]
        if volume is not None:
            args += ["-v", f"{volume}:/var/lib/cloche"]
        docker(*args, image, *command)
        self.tcp_port = self.http_port = 0

    def ready(self, timeout_s: float = 120.0) -> Container:
        """Wait until /health answers 200 (ports are read anew: a restart may change them)."""
        deadline = time.monotonic() + timeout_s * slowness()
        while True:
            state = self.inspect()["State"]
            if not state["Running"]:
                raise RuntimeError(f"container exited {state['ExitCode']}:\n{self.logs()}")
            ports = self.inspect()["NetworkSettings"]["Ports"] or {}
            if ports.get("8000/tcp") and ports.get("8080/tcp"):
                self.tcp_port = int(ports["8000/tcp"][0]["HostPort"])
                self.http_port = int(ports["8080/tcp"][0]["HostPort"])
                try:
                    if self.get("/health")[0] == 200:
                        return self
                except (OSError, urllib.error.URLError):
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy in time ({timeout_s} s here):\n{self.logs()}")
            time.sleep(0.5)  # polling for /health, with a deadline

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.url(path), timeout=30 * slowness()) as response:  # noqa: S310
            return response.status, response.read().decode()

    def post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        request = urllib.request.Request(  # noqa: S310  # our own test URL
            self.url(path),
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120 * slowness()) as response:  # noqa: S310
            answer: dict[str, object] = json.loads(response.read())
            return answer

    def exec(self, *command: str) -> str:
        """What a command run inside the container prints."""
        return docker("exec", self.name, *command)

    def inspect(self) -> dict[str, object]:
        found: list[dict[str, object]] = json.loads(docker("inspect", self.name))
        return found[0]

    def logs(self) -> str:
        done = subprocess.run(
            ["docker", "logs", self.name],
            capture_output=True,
            text=True,
            timeout=60 * slowness(),
            check=False,
        )
        return done.stdout + done.stderr

    def stop(self, timeout_s: int = 60) -> int:
        """`docker stop` (SIGTERM, then SIGKILL after timeout_s); the exit code."""
        grace_s = round(timeout_s * slowness())
        docker("stop", "-t", str(grace_s), self.name, timeout_s=timeout_s + 60)
        return int(docker("inspect", "--format", "{{.State.ExitCode}}", self.name))

    def restart(self) -> Container:
        """`docker restart` (SIGTERM, then start again on the same volume), then ready() again:
        for "a session survives a restart" once --data-dir (CLOCHE_DATA_DIR) saves sessions."""
        docker("restart", "-t", str(round(60 * slowness())), self.name, timeout_s=180)
        return self.ready()

    def remove(self) -> None:
        docker("rm", "--force", "--volumes", self.name, check=False)


@pytest.fixture(scope="session")
def image(docker_daemon: None) -> str:
    build_image(IMAGE)
    return IMAGE


@pytest.fixture
def run_container(image: str) -> Iterator[Callable[..., Container]]:
    """Start containers of the image: run_container(*docker_flags, env=..., volume=...)."""
    started: list[Container] = []
    volumes: list[str] = []

    def run(*flags: str, volume: bool = True, **kwargs: Any) -> Container:
        name = None
        if volume:
            name = f"cloche-test-data-{uuid.uuid4().hex[:8]}"
            volumes.append(name)
        started.append(Container(*flags, volume=name, image=image, **kwargs))
        return started[-1]

    yield run
    for container in started:
        container.remove()
    for name in volumes:
        docker("volume", "rm", "--force", name, check=False)


@pytest.fixture(scope="module")
def served(image: str) -> Iterator[Container]:
    """One container run with the README's flags, shared by a module's protocol checks."""
    volume = f"cloche-test-data-{uuid.uuid4().hex[:8]}"
    container = Container(*RUN_FLAGS, volume=volume, image=image)
    try:
        yield container.ready()
    finally:
        container.remove()
        docker("volume", "rm", "--force", volume, check=False)
