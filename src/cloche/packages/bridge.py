"""The host's side of a kernel's `%pip install` requests (as `cloche.llm.bridge` is for
llm_query).

    kernel -> host  {"op": "pip", "id": int, "requirements": [str, ...]}
    host -> kernel  {"op": "pip_reply", "id": int, "installed": [{"name", "version"}],
                     "satisfied": [str, ...], "pth": [str, ...]}
                    {"op": "pip_reply", "id": int, "error": str[, "interrupted": true]}

The kernel is hostile: a request of the wrong shape raises InvalidMessage (and the
sandbox is killed); a requirement the policy refuses is answered with an error, which the
cell raises as PackageInstallError. The cell's clock is held while the host installs (up
to --package-timeout); an interrupt cancels the install and is answered at once.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cloche.errors import InvalidMessage, PackageInstallError
from cloche.kernel.pip import FUNCTION
from cloche.packages.installer import SessionPackages
from cloche.packages.requirements import MAX_REQUIREMENT_CHARS, MAX_REQUIREMENTS

log = logging.getLogger("cloche.packages")

_MAX_ID = 2**53
_KEYS = frozenset({"op", "id", "requirements"})


class Kernel(Protocol):
    """What the installer's side needs of a session's kernel client."""

    def hold_deadline(self, cell: Any, held: bool) -> None: ...

    def send(self, message: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class SilentRun:
    """How the silent cell that ran an install ended (the session layer's result, told in
    the words this layer needs)."""

    ok: bool  # the cell ended normally
    ended: str  # how it ended otherwise (timeout, interrupted, killed, ...)
    message: str  # the session layer's words for that
    error: dict[str, Any] | None  # the exception the cell raised: {ename, evalue, ...}


def parse_request(message: dict[str, Any]) -> tuple[int, list[str]]:
    """(id, requirements) of a kernel's request. Raises InvalidMessage."""
    if not _KEYS.issuperset(message):
        raise InvalidMessage("pip request with unknown fields")
    request_id, specs = message.get("id"), message.get("requirements")
    if type(request_id) is not int or not 0 < request_id < _MAX_ID:
        raise InvalidMessage("pip request without a valid id")
    if not isinstance(specs, list) or len(specs) > MAX_REQUIREMENTS * 2:
        raise InvalidMessage("pip request without a list of requirements")
    for spec in specs:
        if not isinstance(spec, str) or len(spec) > MAX_REQUIREMENT_CHARS * 2:
            raise InvalidMessage("pip requirement that is not a short str")
    return request_id, specs


class KernelPip:
    """Answers one session's `%pip install` requests, one at a time."""

    def __init__(self, packages: SessionPackages | None, kernel: Kernel) -> None:
        self.packages = packages
        self.kernel = kernel
        self._task: asyncio.Task[None] | None = None
        self._cell: object | None = None
        self._interrupted = False
        self.last: dict[str, Any] | None = None  # the last reply (for the HTTP route)

    def request(self, cell: object, message: dict[str, Any]) -> None:
        """Take a request of the running cell. Raises InvalidMessage."""
        request_id, specs = parse_request(message)
        if self._task is not None and not self._task.done():
            self.kernel.send(self._error(request_id, "one pip install at a time"))
            return
        if self.packages is None:
            self.kernel.send(self._error(request_id, "this sandbox has no site directory"))
            return
        self._cell = cell
        self._interrupted = False
        self.kernel.hold_deadline(cell, True)
        self._task = asyncio.create_task(self._answer(cell, request_id, specs))

    def stop(self, cell: object, interrupted: bool = True) -> None:
        """Cancel the cell's install in flight, if any."""
        if cell is self._cell and self._task is not None and not self._task.done():
            self._interrupted = interrupted
            self._task.cancel()

    def end(self, cell: object) -> None:
        """The cell is over: nothing more is sent for it."""
        self.stop(cell, interrupted=False)
        if cell is self._cell:
            self._cell = None

    async def _answer(self, cell: object, request_id: int, specs: list[str]) -> None:
        assert self.packages is not None
        reply: dict[str, Any]
        try:
            result = await self.packages.install(specs)
            reply = {
                "op": "pip_reply",
                "id": request_id,
                "installed": [{"name": p.name, "version": p.version} for p in result.installed],
                "satisfied": result.satisfied,
                "pth": result.pth,
            }
        except PackageInstallError as exc:
            reply = self._error(request_id, str(exc))
        except asyncio.CancelledError:
            reply = self._error(request_id, "the install was interrupted")
            if self._interrupted:
                reply["interrupted"] = True
        except Exception:
            log.exception("pip install failed")
            reply = self._error(request_id, "the install failed inside the server")
        self.last = reply
        if cell is self._cell:
            self.kernel.hold_deadline(cell, False)
            self.kernel.send(reply)

    async def install_through_cell(
        self, specs: list[str], run_silent: Callable[[str], Awaitable[SilentRun]]
    ) -> list[dict[str, str]]:
        """Install as `%pip install` would, in a silent cell queued behind the session's
        others (for the HTTP API); [{name, version}] installed. Raises PackageInstallError."""
        self.last = None
        result = await run_silent(f"{FUNCTION}({shlex.join(['install', '-q', *specs])!r})")
        if result.error is not None:
            raise PackageInstallError(result.error["evalue"] or result.error["ename"])
        if not result.ok or self.last is None:
            raise PackageInstallError(result.message or f"the install ended {result.ended}")
        if "error" in self.last:
            raise PackageInstallError(str(self.last["error"]))
        return list(self.last.get("installed", []))

    @staticmethod
    def _error(request_id: int, why: str) -> dict[str, Any]:
        return {"op": "pip_reply", "id": request_id, "error": why}
