"""The shared wheel cache: each wheel stored once, under its sha256, for every session.

A wheel is put in place by rename only after its hash was checked, so a reader never sees
a partial or a wrong file, and two servers (or installs) filling it at once do no harm.
"""

from __future__ import annotations

import hashlib
import secrets
import shutil
from pathlib import Path

from cloche.errors import PackageInstallError
from cloche.packages.resolver import Pip, Wheel

_CHUNK_BYTES = 1 << 20


class WheelCache:
    """Wheels by hash under root."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def prepare(self) -> None:
        """Create the cache's directories (blocking)."""
        (self.root / "wheels").mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.root / "tmp").mkdir(exist_ok=True, mode=0o700)

    def path(self, wheel: Wheel) -> Path | None:
        """Where wheel is cached; None when its hash is unknown (it can't be cached)."""
        if wheel.sha256 is None or len(wheel.sha256) != 64:
            return None
        return self.root / "wheels" / wheel.sha256[:2] / wheel.sha256 / wheel.filename

    def has(self, wheel: Wheel) -> bool:
        path = self.path(wheel)
        return path is not None and path.is_file()

    async def fetch(self, pip: Pip, wheels: list[Wheel]) -> dict[Wheel, Path]:
        """The cached file of every wheel, downloading those missing. Raises
        PackageInstallError (a download failed, or a file doesn't match its hash)."""
        for wheel in wheels:
            if self.path(wheel) is None:
                raise PackageInstallError(
                    f"the package index gave no sha256 for {wheel.filename}: refused"
                )
        missing = [wheel for wheel in wheels if not self.has(wheel)]
        found: dict[Wheel, Path] = {}
        if missing:
            staging = self.root / "tmp" / secrets.token_hex(8)
            staging.mkdir(parents=True)
            try:
                await pip.download(missing, staging)
                for wheel in missing:
                    found[wheel] = self._keep(wheel, staging / wheel.filename)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        for wheel in wheels:
            if wheel not in found:
                path = self.path(wheel)
                assert path is not None
                found[wheel] = path
        return found

    def _keep(self, wheel: Wheel, downloaded: Path) -> Path:
        if not downloaded.is_file():
            raise PackageInstallError(f"pip did not download {wheel.filename}")
        digest = _sha256(downloaded)
        if wheel.sha256 is not None and digest != wheel.sha256:
            raise PackageInstallError(
                f"{wheel.filename} does not match its sha256 from the index ({digest})"
            )
        path = self.path(wheel)
        assert path is not None  # fetch checked
        path.parent.mkdir(parents=True, exist_ok=True)
        downloaded.replace(path)
        return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
