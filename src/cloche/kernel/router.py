"""The kernel's reader of its channel: every frame from the host goes to whoever it is for.

Between cells the main thread reads the channel itself (a cell's frame reaches it without a
thread's hand-off, the warm cell's cost); while a cell runs, the router's thread reads it.
The turn passes at a cell's start (the main thread wakes the router and runs the cell) and
at its end (the main thread, its `done` sent, wakes the router out of its wait through a
pipe and takes the channel back). Whoever reads routes each frame:
    exec                          -> the main thread, which runs cells one at a time
    llm_reply, pip_reply, ...     -> the cell's caller waiting for it (`llm.Bridge`)
    proc.*                        -> the process supervisor (`procd`), over its socket
    ports.*                       -> the ports' relay (`ports`), over its socket
A thread for each carries its frames (process output, exits, replies) to the host, whole,
through the channel's lock, so they interleave with the cell's messages only between
frames. The kernel never waits on either: a command that floods its output is held back by
the supervisor's own flow control, never by the cell.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import struct
import threading
from typing import Any

from .channel import WOKEN, Channel
from .llm import Bridge

_HEADER = struct.Struct(">I")
_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_MAX_SUPERVISOR_FRAME = 64 << 20  # the supervisor's frames are small (output in pieces)


class Router:
    """Reads the host's frames in a thread of its own and routes them."""

    def __init__(
        self,
        channel: Channel,
        bridge: Bridge,
        supervisor: socket.socket | None,
        relay: socket.socket | None = None,
    ):
        self._channel = channel
        self._bridge = bridge
        self._supervisor = supervisor
        self._relay = relay  # the ports' relay
        self._send_lock = threading.Lock()  # frames to the supervisor go whole
        self._turn = threading.Condition()
        self._routers_turn = False  # the router's thread reads the channel (a cell runs)
        self._gone = False  # the host closed the channel
        self._cells: collections.deque[dict[str, Any]] = collections.deque()  # read by it
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.thread = threading.Thread(target=self._read_host, name="cloche-router", daemon=True)

    def start(self) -> None:
        self.thread.start()
        for name, helper in (("cloche-procd", self._supervisor), ("cloche-ports", self._relay)):
            if helper is not None:
                threading.Thread(
                    target=self._read_helper, args=(helper,), name=name, daemon=True
                ).start()

    def next_cell(self) -> dict[str, Any] | None:
        """The next `exec` message, or None once the host has gone; called by the main
        thread between cells. It takes the channel back from the router's thread, reads and
        routes frames itself until a cell comes, then hands the channel to that thread for
        the cell's time."""
        self._take_back()
        while not self._cells and not self._gone:
            try:
                message = self._channel.recv()
            except Exception:  # the host sends valid frames; else it is gone
                message = None
            if message is None:
                self._lost()
            else:
                self._route(message)
        if not self._cells:
            return None
        self.hand_over()
        return self._cells.popleft()

    def hand_over(self) -> None:
        """Let the router's thread read the channel until `next_cell` takes it back."""
        if self._gone:  # its thread has ended
            return
        with self._turn:
            self._routers_turn = True
            self._turn.notify()

    def _take_back(self) -> None:
        with self._turn:
            if self._routers_turn:
                os.write(self._wake_w, b"!")
                while self._routers_turn:
                    self._turn.wait()
            try:  # a wake the router took its turn's end from another cause for
                os.read(self._wake_r, 64)
            except BlockingIOError:
                pass

    def _read_host(self) -> None:
        while True:
            with self._turn:
                while not self._routers_turn:
                    self._turn.wait()
            try:
                while (message := self._channel.recv(self._wake_r)) is not WOKEN:
                    if message is None:
                        self._lost()
                        break
                    self._route(message)
            except Exception:  # the host sends valid frames; else it is gone
                self._lost()
            with self._turn:
                self._routers_turn = False
                self._turn.notify_all()
            if self._gone:
                return

    def close(self, timeout_s: float) -> None:
        """Once the host has closed the channel: wait for the router's thread to end, and
        close the wake pipe (a kernel's router lives as long as it; a test's does not)."""
        self.thread.join(timeout_s)
        if not self.thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _lost(self) -> None:
        if not self._gone:
            self._gone = True
            self._bridge.lost()

    def _route(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "exec":  # read by the router's thread: the next cell, sent as one ended
            self._cells.append(message)
        elif isinstance(op, str) and op.startswith("proc."):
            self._to_supervisor(message)
        elif isinstance(op, str) and op.startswith("ports."):
            self._to_relay(message)
        else:
            self._bridge.deliver(message)

    def _to_supervisor(self, message: dict[str, Any]) -> None:
        if self._supervisor is None:
            if "rid" in message:
                self._channel.send(
                    {"op": "proc.reply", "rid": message["rid"], "error": "no process supervisor"}
                )
            return
        body = _encoder.encode(message).encode("utf-8", "backslashreplace")
        with self._send_lock:
            self._supervisor.sendall(_HEADER.pack(len(body)) + body)

    def _to_relay(self, message: dict[str, Any]) -> None:
        """A request for the ports' relay; answered here if the relay is gone (a cell may
        have killed it: it runs as the session's user)."""
        if self._relay is not None:
            body = _encoder.encode(message).encode("utf-8", "backslashreplace")
            try:
                self._relay.sendall(_HEADER.pack(len(body)) + body)
                return
            except OSError:
                pass
        if "rid" in message:
            why = "the sandbox's port relay is not running"
            self._channel.send({"op": "proc.reply", "rid": message["rid"], "error": why})

    def _read_helper(self, helper: socket.socket) -> None:
        """Forward a helper's frames to the host as they are (it frames them itself)."""
        reader = helper.makefile("rb", buffering=1 << 16)
        try:
            while True:
                header = reader.read(_HEADER.size)
                if len(header) < _HEADER.size:
                    return
                (length,) = _HEADER.unpack(header)
                if length > _MAX_SUPERVISOR_FRAME:
                    return
                body = reader.read(length)
                if len(body) < length:
                    return
                self._channel.send_frame(header + body)
        except OSError:
            return
        finally:
            reader.close()


def drop_privileges(uid: int, gid: int, home: str) -> None:
    """Become the session's user for good (the kernel runs cells as it)."""
    os.setgroups([gid])
    os.setgid(gid)
    os.setuid(uid)
    try:
        os.chdir(home)
    except OSError:
        pass
