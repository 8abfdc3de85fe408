"""How the sessions of one machine ended: counted, told, and numbered for a cluster.

Each end is counted by the manager's word for it (`closed`, `idle`, `lost`, ...) and told
to the observer with its typed end reason (operations.md); a session whose sandbox died is
told once that death is explained (an OOM kill is told apart from other deaths after the
sandbox's process has exited). Those that ended on their own (idle timeout, lifetime) are
numbered, so that a cluster's directory forgets them as it forgets those a front end closed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from typing import Any

from cloche.sessions.kernel import KernelClient
from cloche.sessions.observer import Observer
from cloche.sessions.session import Session

ENDED_KEPT = 10_000  # sessions that ended on their own, remembered for a cluster's directory
_EXPIRED = frozenset({"idle", "lifetime"})  # ends no front end asked for
DIED = frozenset({"lost", "killed"})  # ends in which the sandbox died
SETTLE_WAIT_S = 5.0  # a dead sandbox's death is told once explained, or after this


class Ends:
    """The ends of the sessions of one manager, told to its observer."""

    def __init__(
        self, observer: Observer, in_background: Callable[[Coroutine[Any, Any, None]], None]
    ) -> None:
        self.observer = observer
        self._in_background = in_background
        self.by_reason: Counter[str] = Counter()
        # Sessions that ended on their own (see since), numbered from 1.
        self._ended: deque[tuple[int, str]] = deque(maxlen=ENDED_KEPT)
        self.seq = 0

    def add(self, session: Session, reason: str) -> None:
        """A session ended (it is no longer the manager's): count it and tell of it."""
        self.by_reason[reason] += 1
        kernel = session.kernel
        if reason in DIED and kernel is not None and not kernel.settled.is_set():
            self._in_background(self._tell_when_settled(session, reason, kernel))
        else:
            self._tell(session, reason, kernel)
        if reason in _EXPIRED:
            self.seq += 1
            self._ended.append((self.seq, session.id))

    def since(self, seq: int) -> list[str]:
        """Sessions that ended here on their own (idle timeout, lifetime) after the
        `seq` seq, oldest first (the last ENDED_KEPT)."""
        return [session_id for number, session_id in self._ended if number > seq]

    async def _tell_when_settled(self, session: Session, reason: str, kernel: KernelClient) -> None:
        """Tell of a session whose sandbox died once its death is explained."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(kernel.settled.wait(), SETTLE_WAIT_S)
        self._tell(session, reason, kernel)

    def _tell(self, session: Session, reason: str, kernel: KernelClient | None) -> None:
        end_reason = _end_reason(reason, kernel)
        self.observer.session_closed(reason, end_reason)
        data = {"end_reason": end_reason, "reason": reason, "cells": session.history.last_number}
        self.observer.event("session.closed", session.id, session.owner_key, data)


def _end_reason(reason: str, kernel: KernelClient | None) -> str:
    """A session's typed end reason (operations.md) for the manager's own word for it."""
    if reason in DIED:  # its sandbox died
        died_of = kernel.death_reason if kernel is not None else ""
        return "oom_killed" if died_of == "memory" else "sandbox_died"
    return _END_REASONS.get(reason, "closed")


# The manager's words for an end that is not a close asked for (closed, deleted, shutdown,
# a fork's copy that failed, ...: all "closed").
_END_REASONS = {"idle": "idle_timeout", "lifetime": "lifetime", "broken": "restart_failed"}
