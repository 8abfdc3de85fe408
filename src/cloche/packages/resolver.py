"""pip as a tool: resolve requirements to wheels for the sandbox's interpreter, and fetch them.

pip runs in a subprocess of the same interpreter the sandbox runs (same version, same
platform tags), started with -I -S so that it sees neither the host's site-packages nor the
environment, with only pip itself and, after the standard library, the session's runtime
on its path: what the runtime has counts as installed and is not fetched again. The
session's site directory, which the sandbox writes, is never on it (a module planted there
would run on the host); what a session installed before is pinned by a constraints file
instead. No package is imported, built or run: only wheels are accepted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from packaging.utils import canonicalize_name

from cloche.errors import PackageInstallError

log = logging.getLogger("cloche.packages")

_BOOT = (
    "import sys;sys.path.insert(0,sys.argv.pop(1));runtime=sys.argv.pop(1);"
    "runtime and sys.path.append(runtime);"
    "from pip._internal.cli.main import main;sys.exit(main(sys.argv[1:]))"
)
_COMMON = ("--disable-pip-version-check", "--no-input", "--no-color")
_OUTPUT_BYTES = 64 * 1024  # of pip's stderr kept for an error message
_NO_MATCH = re.compile(r"No matching distribution found for (\S+)")
# A resolution is reused for this long: the same install in the next session (the common
# case: every agent's session asks for the same packages) skips pip and the index.
RESOLUTION_TTL_S = 300.0
_CONFLICT = re.compile(r"ResolutionImpossible|conflicting dependencies|Cannot install")


@dataclass(frozen=True)
class Wheel:
    """One wheel the resolution chose."""

    name: str  # normalised
    version: str
    url: str
    sha256: str | None

    @property
    def filename(self) -> str:
        return os.path.basename(urlsplit(self.url).path)


class Pip:
    """Runs pip (the server's own copy) for one interpreter and runtime.

    Args:
        python: The interpreter the sandbox runs (wheels are chosen for it).
        runtime_dir: The session runtime's site-packages on the host, or None.
        tool_dir: A directory of ours to hold a link to pip (nothing else is put there);
            pip's own HTTP cache goes beside it, in pip-http/.
        index_url: --package-index, or None for pip's own configuration.
        timeout_s: Longest a pip run may take.
    """

    def __init__(
        self,
        python: str,
        runtime_dir: Path | None,
        tool_dir: Path,
        index_url: str | None,
        timeout_s: float,
    ) -> None:
        self.python = python
        self.runtime_dir = runtime_dir
        self.tool_dir = tool_dir
        self.index_url = index_url
        self.timeout_s = timeout_s
        self._resolved: dict[tuple[object, ...], tuple[float, list[Wheel]]] = {}

    def prepare(self) -> None:
        """Link pip into tool_dir (blocking)."""
        import pip

        self.tool_dir.mkdir(parents=True, exist_ok=True)
        link = self.tool_dir / "pip"
        target = Path(pip.__file__).resolve().parent
        if not link.is_symlink() or link.resolve() != target:
            temp = self.tool_dir / f".pip-{os.getpid()}"
            temp.unlink(missing_ok=True)
            temp.symlink_to(target)
            temp.replace(link)

    def _index_args(self) -> list[str]:
        return ["--index-url", self.index_url] if self.index_url else []

    async def resolve(
        self, requirements: list[str], pinned: dict[str, str], runtime_dir: Path | None = None
    ) -> list[Wheel]:
        """The wheels to install for requirements, beside pinned (name -> version) and the
        runtime (runtime_dir, by default the one given at construction); a resolution
        of the same within RESOLUTION_TTL_S is reused. Raises PackageInstallError."""
        key = (tuple(requirements), tuple(sorted(pinned.items())), runtime_dir)
        now = time.monotonic()
        cached = self._resolved.get(key)
        if cached is not None and now - cached[0] < RESOLUTION_TTL_S:
            return list(cached[1])
        wheels = await self._resolve(requirements, pinned, runtime_dir)
        self._resolved = {k: v for k, v in self._resolved.items() if now - v[0] < RESOLUTION_TTL_S}
        self._resolved[key] = (now, wheels)
        return list(wheels)

    async def _resolve(
        self, requirements: list[str], pinned: dict[str, str], runtime_dir: Path | None
    ) -> list[Wheel]:
        with tempfile.TemporaryDirectory(prefix="cloche-pip-") as work:
            constraints = Path(work) / "constraints.txt"
            constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pinned.items())))
            report = Path(work) / "report.json"
            args = [
                "install",
                "--dry-run",
                "--quiet",
                "--only-binary=:all:",
                "--break-system-packages",  # nothing is installed: this is a dry run
                "--report",
                str(report),
                "--constraint",
                str(constraints),
                *self._index_args(),
                "--",
                *requirements,
            ]
            code, output = await self._run(args, runtime_dir)
            if code != 0:
                raise PackageInstallError(await self._explain(requirements, output))
            data = json.loads(report.read_text())
        wheels = []
        for item in data.get("install", []):
            metadata, info = item.get("metadata", {}), item.get("download_info", {})
            url = str(info.get("url", ""))
            hashes = info.get("archive_info", {}).get("hashes", {})
            if not url.endswith(".whl"):
                raise PackageInstallError(f"pip chose {url!r}, which is not a wheel")
            wheels.append(
                Wheel(
                    canonicalize_name(str(metadata.get("name", ""))),
                    str(metadata.get("version", "")),
                    url,
                    hashes.get("sha256"),
                )
            )
        return wheels

    async def download(self, wheels: list[Wheel], into: Path) -> None:
        """Download wheels (by their exact URL and hash) into the directory into."""
        urls = [f"{w.url}#sha256={w.sha256}" if w.sha256 else w.url for w in wheels]
        args = ["download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", str(into)]
        code, output = await self._run([*args, *self._index_args(), "--", *urls])
        if code != 0:
            raise PackageInstallError(f"downloading the wheels failed: {_last_error(output)}")

    async def _explain(self, requirements: list[str], output: str) -> str:
        """A clear message for a failed resolution."""
        missing = _NO_MATCH.search(output)
        if missing:
            wanted = missing.group(1)
            name = re.split(r"[\s<>=!~;\[(]", wanted, maxsplit=1)[0]
            versions = await self._any_versions(name)
            if versions:
                return (
                    f"{wanted} has no wheel for this sandbox's Python "
                    f"({sys.implementation.name} {sys.version_info[0]}.{sys.version_info[1]}, "
                    f"{sys.platform}), only source distributions (sdists) or wheels for other "
                    f"platforms (versions: {versions}); sdists are refused because building "
                    "one runs its code on the server (--allow-sdist, building inside a "
                    "sandbox, is not implemented)"
                )
            return f"no package {wanted} on the package index (or no release that matches)"
        if _CONFLICT.search(output):
            return f"the packages' requirements conflict: {_last_error(output)}"
        return f"pip could not resolve {' '.join(requirements)}: {_last_error(output)}"

    async def _any_versions(self, name: str) -> str:
        """Versions of name on the index in any form (sdists too); '' when none."""
        code, output = await self._run(["index", "versions", *self._index_args(), "--", name])
        if code != 0:
            return ""
        for line in output.splitlines():
            if line.startswith("Available versions:"):
                return line.split(":", 1)[1].strip()[:200]
        return ""

    async def _run(self, args: list[str], runtime_dir: Path | None = None) -> tuple[int, str]:
        """(exit status, output) of a pip run; killed after timeout_s."""
        runtime_dir = runtime_dir or self.runtime_dir
        runtime = str(runtime_dir) if runtime_dir is not None else ""
        command = [self.python, "-I", "-S", "-c", _BOOT, str(self.tool_dir), runtime]
        process = await asyncio.create_subprocess_exec(
            *command,
            *args[:1],
            *_COMMON,
            "--cache-dir",
            str(self.tool_dir.parent / "pip-http"),
            *args[1:],
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            async with asyncio.timeout(self.timeout_s):
                output, _ = await process.communicate()
        except BaseException as exc:  # the timeout, or the install was cancelled
            if process.returncode is None:
                process.kill()
                await process.wait()
            if isinstance(exc, TimeoutError):
                raise PackageInstallError(
                    f"pip took more than {self.timeout_s:g} s (the index is slow or unreachable)"
                ) from None
            raise
        text = output[-_OUTPUT_BYTES:].decode(errors="replace")
        log.debug("pip %s -> %s: %s", args[0], process.returncode, text)
        return process.returncode or 0, text


def _last_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    picked = (errors or lines or ["(no output)"])[-3:]
    return " / ".join(picked)[:1000]
