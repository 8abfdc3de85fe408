"""The host's side of a kernel's processes: requests to its supervisor, and their output.

The supervisor (`cloche.kernel.procd`) runs a session's commands and terminals beside its
kernel; its frames come over a link of its own (`supervisor_link`). Like everything from
the sandbox, they are untrusted: each is checked here, and a malformed one ends the link
(the session's commands fail from then on; its cells go on).

Output is taken by watchers (a foreground run, an attached stream, a terminal's
websocket). The supervisor sends a process's output only while less than its window is
unacknowledged, and a piece is acknowledged once every watcher that was there when it
came has taken it: a slow client slows its command down, as a slow terminal does, and
never fills the server's memory. Output nobody watches is acknowledged and dropped.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from cloche.errors import InvalidMessage, ProcessError, ProcessNotFound

RECENT_ENDS = 256  # ended processes whose end is remembered, for a late wait
REQUEST_TIMEOUT_S = 30.0  # the supervisor answers at once; past this it is stuck
REST_TIMEOUT_S = 5.0  # `rest` before a checkpoint: past this, the image keeps the spare


@dataclass(frozen=True)
class Output:
    """A piece of a process's output."""

    pid: int
    fd: int  # 1 stdout (a terminal's too), 2 stderr
    data: bytes


@dataclass(frozen=True)
class Exit:
    """A process's end: its exit code, or the signal that ended it; neither when its
    sandbox was lost (or, suspended, paused: it goes on when the session is resumed)."""

    pid: int
    exit_code: int | None
    signal: int | None
    suspended: bool = False


Event = Output | Exit


@dataclass
class _Piece:
    output: Output
    owed: int  # watchers that have yet to take it


@dataclass
class Watcher:
    """A listener to one process: events in order, ending with its Exit (or a lost one)."""

    pid: int
    table: ProcessTable
    queue: asyncio.Queue[tuple[Event, _Piece | None] | None] = field(default_factory=asyncio.Queue)
    closed: bool = False

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        try:
            while (item := await self.queue.get()) is not None:
                event, piece = item
                if piece is not None:
                    self.table._taken(piece)
                yield event
                if isinstance(event, Exit):
                    return
        finally:
            self.close()

    def abandon(self) -> None:
        """Stop listening and end the events at once, without the process's end (which
        its supervisor did not tell)."""
        self.close()
        self.queue.put_nowait(None)

    def close(self) -> None:
        """Stop listening; pieces not taken yet count as taken."""
        if self.closed:
            return
        self.closed = True
        self.table._unwatch(self)
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is not None and item[1] is not None:
                self.table._taken(item[1])


class ProcessTable:
    """One kernel's processes as the host sees them: its requests and their answers, its
    watchers, and the ends of processes seen lately."""

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        self._send = send
        self._rids = itertools.count(1)
        self._asked: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._watchers_for: dict[int, int] = {}  # watchers a start wants made with its reply
        self._watchers: dict[int, list[Watcher]] = {}
        self.ended: collections.OrderedDict[int, Exit] = collections.OrderedDict()
        self.lost_why: str | None = None
        self.on_exit: Callable[[Exit], None] | None = None  # the session's bookkeeping

    async def start(self, watchers: int = 1, **fields: Any) -> tuple[int, list[Watcher]]:
        """Start a process (`proc.start`'s fields); its pid, and watchers of it from its
        very first output.

        Raises:
            ProcessError: the supervisor refused (its reason), or the sandbox is gone.
        """
        reply = await self.request("proc.start", _watchers=watchers, **fields)
        pid = reply.get("pid")
        if type(pid) is not int:
            raise ProcessError("the sandbox's process supervisor answered without a pid")
        return pid, list(reply.get("_watchers") or [])

    async def request(
        self, op: str, _watchers: int = 0, _timeout_s: float = REQUEST_TIMEOUT_S, **fields: Any
    ) -> dict[str, Any]:
        """Ask the supervisor; its answer (within _timeout_s).

        Raises:
            ProcessNotFound: the process named is not running.
            ProcessError: the supervisor refused (its reason), or the sandbox is gone.
        """
        if self.lost_why is not None:
            raise ProcessError(self.lost_why)
        rid = next(self._rids)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._asked[rid] = answer
        self._watchers_for[rid] = _watchers
        try:
            self._send({"op": op, "rid": rid, **fields})
            async with asyncio.timeout(_timeout_s):
                reply = await answer
        except TimeoutError:
            raise ProcessError(
                f"the sandbox's process supervisor did not answer {op} in {_timeout_s:g} s"
            ) from None
        finally:
            self._asked.pop(rid, None)
            self._watchers_for.pop(rid, None)
        error = reply.get("error")
        if isinstance(error, str):
            if "is not running" in error:
                raise ProcessNotFound(error)
            raise ProcessError(error)
        return reply

    async def rest(self) -> None:
        """Before a checkpoint: the supervisor lets go of the leader it keeps ready for the
        next command (each process adds about its own size to the image), forks none until
        a command asks, and ends its link to the host once it has answered
        (`SupervisorLink.rest`). Best effort: a checkpoint is never refused for it."""
        if self.lost_why is None:
            with contextlib.suppress(ProcessError):
                await self.request("proc.rest", _timeout_s=REST_TIMEOUT_S)

    @property
    def asking(self) -> bool:
        """Whether a request waits for the supervisor's answer."""
        return bool(self._asked)

    async def known(self, pid: int) -> None:
        """Return if pid is running or ended lately.

        Raises:
            ProcessNotFound: neither (its end, told while it was asked about, counts: the
                supervisor tells an end before it answers that the process is gone).
        """
        if pid in self.ended:
            return
        try:
            await self.request("proc.signal", pid=pid, signal=0)
        except ProcessNotFound:
            if pid not in self.ended:
                raise

    def watch(self, pid: int) -> Watcher:
        """Listen to pid's output from now on, and its end (at once if it ended lately)."""
        watcher = Watcher(pid, self)
        ended = self.ended.get(pid)
        if ended is not None or self.lost_why is not None:
            watcher.queue.put_nowait((ended or Exit(pid, None, None), None))
        else:
            self._watchers.setdefault(pid, []).append(watcher)
        return watcher

    def watched(self, pid: int) -> bool:
        return bool(self._watchers.get(pid))

    # -- frames from the supervisor ----------------------------------------------------

    def on_message(self, message: dict[str, Any]) -> None:
        """A `proc.*` frame from the supervisor. Raises InvalidMessage for a malformed one."""
        op = message.get("op")
        if op == "proc.reply":
            rid = message.get("rid")
            if type(rid) is not int:
                raise InvalidMessage("a process supervisor's reply without its request's id")
            answer = self._asked.get(rid)
            if answer is not None and not answer.done():
                pid = message.get("pid")
                wanted = self._watchers_for.get(rid, 0)  # made now: no output goes by first
                if wanted and type(pid) is int and "error" not in message:
                    message["_watchers"] = [self.watch(pid) for _ in range(wanted)]
                answer.set_result(message)
        elif op == "proc.out":
            pid, fd, data = message.get("pid"), message.get("fd"), message.get("data")
            if type(pid) is not int or fd not in (1, 2) or not isinstance(data, str):
                raise InvalidMessage("malformed process output")
            try:
                raw = base64.b64decode(data, validate=True)
            except binascii.Error:
                raise InvalidMessage("malformed process output") from None
            self._deliver(Output(pid, fd, raw))
        elif op == "proc.exit":
            pid, code, number = message.get("pid"), message.get("exit_code"), message.get("signal")
            if type(pid) is not int or not all(v is None or type(v) is int for v in (code, number)):
                raise InvalidMessage("malformed process end")
            self._ended(Exit(pid, code, number))
        else:
            raise InvalidMessage(f"unknown message {str(op)[:40]!r}")

    def _deliver(self, output: Output) -> None:
        watchers = self._watchers.get(output.pid) or []
        if not watchers:
            self._ack(output.pid, len(output.data))
            return
        piece = _Piece(output, len(watchers))
        for watcher in watchers:
            watcher.queue.put_nowait((output, piece))

    def _taken(self, piece: _Piece) -> None:
        piece.owed -= 1
        if piece.owed == 0:
            self._ack(piece.output.pid, len(piece.output.data))

    def _ack(self, pid: int, size: int) -> None:
        if self.lost_why is None:
            self._send({"op": "proc.ack", "pid": pid, "bytes": size})

    def _unwatch(self, watcher: Watcher) -> None:
        watchers = self._watchers.get(watcher.pid)
        if watchers is not None and watcher in watchers:
            watchers.remove(watcher)
            if not watchers:
                del self._watchers[watcher.pid]

    def _ended(self, end: Exit) -> None:
        self.ended[end.pid] = end
        while len(self.ended) > RECENT_ENDS:
            self.ended.popitem(last=False)
        for watcher in self._watchers.pop(end.pid, []):
            watcher.queue.put_nowait((end, None))
        if self.on_exit is not None:
            self.on_exit(end)

    def lost(self, why: str, *, suspended: bool = False) -> None:
        """The kernel is gone: every request fails, every watcher ends (no exit code;
        suspended: its processes go on in the session's saved image)."""
        if self.lost_why is not None:
            return
        self.lost_why = why
        for answer in self._asked.values():
            if not answer.done():
                answer.set_result({"error": why})
        for pid, watchers in list(self._watchers.items()):
            for watcher in watchers:
                watcher.queue.put_nowait((Exit(pid, None, None, suspended), None))
        self._watchers.clear()
