"""`%pip install` and `!pip install` in a cell: the host installs, the cell goes on.

The sandbox has no network. A cell line such as `%pip install -q humanize` becomes a call
of `__cloche_pip__`, which asks the host over the channel (see `cloche.packages.bridge`)
and waits: the host resolves and downloads wheels and unpacks them into the session's
site directory, already on sys.path. Then the import system's caches are refreshed and
the new `.pth` files processed, and the rest of the cell can import the packages. A
refusal or failure raises PackageInstallError in the cell, whose state is untouched.

Only `pip install` is understood, with the options notebooks write that mean nothing here
(-q, -U, --no-cache-dir, ...); anything else is refused with a message.
"""

from __future__ import annotations

import builtins
import importlib
import os
import re
import shlex
import sys
import threading
from typing import Any

from .llm import Bridge

FUNCTION = "__cloche_pip__"
# `%pip ...`, `!pip ...`, `!pip3 ...`, `!python -m pip ...`, `%pip3 ...` on a line of its own.
_LINE = re.compile(
    r"^(?P<indent>[ \t]*)(?:%|!)[ \t]*(?:pip3?|python3?[ \t]+-m[ \t]+pip)(?:[ \t]+(?P<args>.*))?$"
)
_IGNORED = frozenset(
    {
        "-q",
        "--quiet",
        "-qq",
        "-qqq",
        "-U",
        "--upgrade",
        "--no-cache-dir",
        "--user",
        "--disable-pip-version-check",
        "--no-warn-script-location",
        "--progress-bar=off",
        "--root-user-action=ignore",
    }
)


class PackageInstallError(Exception):
    """Packages could not be installed: refused by the server's policy, unknown, without a
    wheel for this sandbox, too large, or the package index failed. Nothing was changed."""


PackageInstallError.__module__ = "builtins"  # shown as a builtin, as the cell sees it


def transform(source: str) -> str:
    """The cell with each `%pip` / `!pip` line made a call (line numbers kept)."""
    if "pip" not in source:
        return source
    lines = source.split("\n")
    for number, line in enumerate(lines):
        match = _LINE.match(line.rstrip("\r"))
        if match is not None:
            args = (match.group("args") or "").strip()
            lines[number] = f"{match.group('indent')}{FUNCTION}({args!r})"
    return "\n".join(lines)


class Pip:
    """The kernel's end of `%pip install`."""

    def __init__(self, bridge: Bridge) -> None:
        self._bridge = bridge
        builtins.__dict__[FUNCTION] = self.run
        builtins.PackageInstallError = PackageInstallError  # type: ignore[attr-defined]

    def run(self, command: str) -> None:
        """Carry out one `pip ...` line of a cell."""
        if threading.current_thread() is not threading.main_thread():
            raise PackageInstallError("%pip runs only in a cell's main thread")
        try:
            words = shlex.split(command)
        except ValueError as exc:
            raise PackageInstallError(f"can't read the pip command: {exc}") from None
        if not words or words[0] != "install":
            raise PackageInstallError(
                "only `pip install PACKAGE...` is available in a session (the server "
                "fetches the packages: the sandbox has no network)"
            )
        quiet = False
        specs: list[str] = []
        for word in words[1:]:
            if word.startswith("-"):
                if word not in _IGNORED:
                    raise PackageInstallError(
                        f"pip option {word} is not available in a session: name packages "
                        "only (the index is the server's --package-index)"
                    )
                quiet = quiet or word.startswith("-q") or word == "--quiet"
            else:
                specs.append(word)
        if not specs:
            raise PackageInstallError("no packages named: %pip install NAME[==VERSION] ...")
        reply = self._bridge.ask({"op": "pip", "requirements": specs})
        error = reply.get("error")
        if error is not None:
            raise PackageInstallError(str(error))
        installed = _installed(reply.get("installed"))
        importlib.invalidate_caches()
        _process_pth(reply.get("pth"))
        if not quiet:
            for spec in reply.get("satisfied") or []:
                print(f"Requirement already satisfied: {spec}")
            if installed:
                print("Successfully installed " + " ".join(f"{n}-{v}" for n, v in installed))


def _process_pth(names: Any) -> None:
    """Run the new packages' `.pth` files, here in the sandbox, as `site` would have at
    start-up (the kernel starts without `site`)."""
    if not isinstance(names, list) or not names:
        return
    import site

    known = set(sys.path)
    for name in names:
        if not isinstance(name, str) or "/" in name or not name.endswith(".pth"):
            continue
        for entry in list(sys.path):
            if os.path.isfile(os.path.join(entry, name)):
                site.addpackage(entry, name, known)
                break


def _installed(value: Any) -> list[tuple[str, str]]:
    if not isinstance(value, list):
        return []
    return [
        (str(item.get("name")), str(item.get("version")))
        for item in value
        if isinstance(item, dict)
    ]
