"""What a session may ask to install: requirement strings, checked before pip sees them."""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from cloche.errors import ConfigError, PackageInstallError

MAX_REQUIREMENTS = 64  # in one install
MAX_REQUIREMENT_CHARS = 200


def parse(specs: list[str]) -> list[Requirement]:
    """Requirements by name and version (extras and markers allowed).

    Raises:
        PackageInstallError: an empty list, too many, an option (`--index-url=...`), a URL,
            a path, or a string that is not a requirement.
    """
    if not specs:
        raise PackageInstallError("no packages named: pip install NAME[==VERSION] ...")
    if len(specs) > MAX_REQUIREMENTS:
        raise PackageInstallError(f"at most {MAX_REQUIREMENTS} packages in one install")
    requirements = []
    for spec in specs:
        if not isinstance(spec, str):
            raise PackageInstallError("a requirement must be a str")
        requirements.append(_parse_one(spec))
    return requirements


def _parse_one(spec: str) -> Requirement:
    shown = repr(spec[:MAX_REQUIREMENT_CHARS])
    if len(spec) > MAX_REQUIREMENT_CHARS:
        raise PackageInstallError(f"requirement {shown}... is over {MAX_REQUIREMENT_CHARS} chars")
    stripped = spec.strip()
    if stripped.startswith("-"):
        raise PackageInstallError(
            f"{shown} is an option of pip: a session can only name packages "
            "(the index is the server's --package-index)"
        )
    if any(c in stripped for c in "/\\\0\n\r") or ".." in stripped or "://" in stripped:
        raise PackageInstallError(
            f"{shown} is refused: only package names and versions (no URLs, paths or files)"
        )
    try:
        requirement = Requirement(stripped)
    except InvalidRequirement as exc:
        raise PackageInstallError(f"{shown} is not a requirement: {exc}") from None
    if requirement.url is not None:
        raise PackageInstallError(f"{shown} is refused: direct URLs are not allowed")
    return requirement


def name_of(requirement: Requirement) -> str:
    """The project's normalised name (PEP 503)."""
    return canonicalize_name(requirement.name)


def read_allow_list(path: Path) -> frozenset[str]:
    """Project names, one a line (`#` starts a comment), normalised.

    Raises:
        ConfigError: the file can't be read, or a line is not a project name.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--packages allow-list:{path}: {exc.strerror}") from None
    names = set()
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            requirement = Requirement(entry)
        except InvalidRequirement:
            requirement = None
        if requirement is None or str(requirement) != requirement.name:
            raise ConfigError(
                f"--packages allow-list:{path} line {number}: {entry!r} is not a project name"
            )
        names.add(canonicalize_name(entry))
    return frozenset(names)
