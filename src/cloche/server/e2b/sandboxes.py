"""E2B sandboxes over cloche sessions: their tokens, deadlines and templates.

A sandbox is a session (same id, manager, owner). What E2B adds lives here, in this
server's memory: each sandbox's end (`timeout`: closed then, or paused with `autoPause`),
whether E2B paused it (a session cloche pages out when idle is still "running" to E2B:
any request brings it back), and its access tokens, derived from a key of this process
(an HMAC of the id), so a session made over `/v1` can be connected to as well. A restart
of the server forgets the deadlines (the sessions' own --idle-timeout and --lifetime still
end them) and changes the tokens (`Sandbox.connect` gives the new ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass

from cloche.errors import ClocheError, SessionNotFound
from cloche.sessions.manager import SessionManager
from cloche.sessions.session import SessionInfo, SessionState

log = logging.getLogger("cloche.e2b")

ENVD_VERSION = "0.5.7"  # the envd features served: octet-stream and gzip uploads, stdin close
DEFAULT_TIMEOUT_S = 300  # E2B's, when a create names none
MAX_TIMEOUT_S = 24 * 3600  # E2B's own ceiling for a sandbox's life
REAP_PERIOD_S = 1.0

# E2B's template names, onto cloche's: (template, profile).
# E2B's code interpreter has the data stack installed, not imported: so has `python`, and
# `lean` sessions come from the warm pool at once (`data` imports it first: name it).
TEMPLATES: dict[str, tuple[str, str]] = {
    "base": ("python", "lean"),
    "code-interpreter-v1": ("python", "lean"),
    "code-interpreter": ("python", "lean"),
    "code-interpreter-stateful": ("python", "lean"),
}


def template_of(template_id: str) -> tuple[str | None, str]:
    """(cloche template, profile) for an E2B templateID: E2B's well-known names as in
    TEMPLATES, `lean` and `data` as profiles of `python`, anything else a cloche template
    (its sessions are lean)."""
    name = template_id.split(":", 1)[0]  # a tag (name:tag) is not kept apart
    if name in TEMPLATES:
        return TEMPLATES[name]
    if name in ("lean", "data", ""):
        return "python", name or "lean"
    return name, "lean"


@dataclass
class Sandbox:
    """What E2B knows of a session beyond cloche."""

    id: str
    owner: str | None  # the token of its owner (the manager's `owner`)
    template_id: str
    end_at: float  # unix time, s
    auto_pause: bool = False
    paused: bool = False  # paused through E2B (pause, or autoPause at its end)


class Sandboxes:
    """This server's E2B sandboxes, and the task that ends them at their time."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager
        self._key = secrets.token_bytes(32)
        self._known: dict[str, Sandbox] = {}
        self._reaper: asyncio.Task[None] | None = None

    # -- tokens ----------------------------------------------------------------------------

    def _token(self, kind: str, sandbox_id: str) -> str:
        mac = hmac.new(self._key, f"{kind}:{sandbox_id}".encode(), hashlib.sha256)
        return mac.hexdigest()[:48]

    def envd_token(self, sandbox_id: str) -> str:
        """envdAccessToken: X-Access-Token on envd's routes and /execute."""
        return self._token("envd", sandbox_id)

    def traffic_token(self, sandbox_id: str) -> str:
        """trafficAccessToken: E2B-Traffic-Access-Token on the interpreter's /contexts."""
        return self._token("traffic", sandbox_id)

    def check(self, kind: str, sandbox_id: str, offered: str | None) -> bool:
        expected = self._token(kind, sandbox_id)
        return offered is not None and hmac.compare_digest(offered.encode(), expected.encode())

    # -- records ---------------------------------------------------------------------------

    def add(
        self,
        info: SessionInfo,
        owner: str | None,
        template_id: str,
        timeout_s: float,
        auto_pause: bool = False,
    ) -> Sandbox:
        sandbox = Sandbox(info.id, owner, template_id, time.time() + timeout_s, auto_pause)
        self._known[info.id] = sandbox
        self._start_reaper()
        return sandbox

    def of(self, info: SessionInfo, owner: str | None) -> Sandbox:
        """The record of a session (one made over /v1 gets one: E2B's default timeout
        from now, its template `base`)."""
        found = self._known.get(info.id)
        if found is None:
            return self.add(info, owner, "base", DEFAULT_TIMEOUT_S)
        return found

    def known(self, sandbox_id: str) -> Sandbox | None:
        return self._known.get(sandbox_id)

    def state(self, info: SessionInfo) -> str:
        found = self._known.get(info.id)
        if info.state is SessionState.PAUSED and found is not None and found.paused:
            return "paused"
        return "running"

    def forget(self, sandbox_id: str) -> None:
        self._known.pop(sandbox_id, None)

    def set_timeout(self, sandbox: Sandbox, timeout_s: float) -> None:
        sandbox.end_at = time.time() + timeout_s

    # -- ends ------------------------------------------------------------------------------

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        while self._known:
            await asyncio.sleep(REAP_PERIOD_S)
            now = time.time()
            for sandbox in list(self._known.values()):
                if sandbox.paused or sandbox.end_at > now:
                    continue
                try:
                    await self.end(sandbox)
                except ClocheError as exc:
                    log.info("sandbox %s could not be ended at its time: %s", sandbox.id, exc)
                    self._known.pop(sandbox.id, None)

    async def end(self, sandbox: Sandbox) -> None:
        """A sandbox reached its time: paused (autoPause) or closed."""
        if sandbox.auto_pause:
            sandbox.paused = True
            try:
                await self.manager.pause(sandbox.id, sandbox.owner)
            except SessionNotFound:
                self._known.pop(sandbox.id, None)
            return
        self._known.pop(sandbox.id, None)
        with contextlib.suppress(SessionNotFound):
            await self.manager.close(sandbox.id, sandbox.owner, reason="timeout")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
