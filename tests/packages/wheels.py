"""Wheels made by tests: well-formed ones, and ones whose archive attacks the host."""

from __future__ import annotations

import stat
import zipfile
from pathlib import Path


def make_wheel(
    directory: Path,
    name: str,
    version: str = "1.0",
    files: dict[str, str] | None = None,
    *,
    evil: list[zipfile.ZipInfo | tuple[str, str]] | None = None,
) -> Path:
    """A py3-none-any wheel of name with files (path -> text), plus evil raw entries."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = directory / f"{dist}-py3-none-any.whl"
    contents = dict(files or {f"{name.replace('-', '_')}/__init__.py": "VALUE = 1\n"})
    contents[f"{dist}.dist-info/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    contents[f"{dist}.dist-info/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: cloche-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    contents[f"{dist}.dist-info/RECORD"] = ""
    with zipfile.ZipFile(path, "w") as archive:
        for entry in evil or []:
            if isinstance(entry, zipfile.ZipInfo):
                archive.writestr(entry, "/etc/passwd")
            else:
                archive.writestr(entry[0], entry[1])
        for file_name, text in contents.items():
            archive.writestr(file_name, text)
    return path


def symlink_entry(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


def simple_index(root: Path, wheels: list[Path]) -> str:
    """A PEP 503 index of wheels under root; its file:// URL."""
    for wheel in wheels:
        project = root / "simple" / wheel.name.split("-")[0].replace("_", "-").lower()
        project.mkdir(parents=True, exist_ok=True)
        (project / wheel.name).write_bytes(wheel.read_bytes())
        (project / "index.html").write_text(
            f'<html><body><a href="{wheel.name}">{wheel.name}</a></body></html>\n'
        )
    return (root / "simple").as_uri()
