"""The kernel's reader of its channel: every frame from the host goes to whoever it is for.

One thread reads the host's frames for the life of the kernel and routes each:
    exec                          -> the main thread, which runs cells one at a time
    llm_reply, pip_reply, ...     -> the cell's caller waiting for it (`llm.Bridge`)
    proc.*, ports.*               -> the process supervisor (`procd`, which serves the
                                     ports' relay too), over its socket
A thread carries its frames (process output, exits, replies) to the host, whole,
through the channel's lock, so they interleave with the cell's messages only between
frames. The kernel never waits on either: a command that floods its output is held back by
the supervisor's own flow control, never by the cell.
"""

from __future__ import annotations

import json
import os
import queue
import select
import socket
import struct
import threading
from typing import Any

from .channel import Channel
from .llm import Bridge

_HEADER = struct.Struct(">I")
_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_MAX_SUPERVISOR_FRAME = 64 << 20  # the supervisor's frames are small (output in pieces)
_HELLO = b'{"op":"proc.hello"}'  # framing.HELLO as it is sent


class Router:
    """Reads the host's frames in a thread of its own and routes them."""

    def __init__(
        self,
        channel: Channel,
        bridge: Bridge,
        supervisor: socket.socket | None,
    ):
        self._channel = channel
        self._bridge = bridge
        self._supervisor = supervisor
        self._send_lock = threading.Lock()  # frames to the supervisor go whole
        self._cells: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()

    def start(self) -> None:
        threading.Thread(target=self._read_host, name="cloche-router", daemon=True).start()
        if self._supervisor is not None:
            threading.Thread(
                target=self._read_supervisor,
                args=(self._supervisor,),
                name="cloche-procd",
                daemon=True,
            ).start()

    def next_cell(self) -> dict[str, Any] | None:
        """The next `exec` message, or None once the host has gone."""
        return self._cells.get()

    def _read_host(self) -> None:
        try:
            while (message := self._channel.recv()) is not None:
                self._route(message)
        except Exception:  # noqa: S110  # the host sends valid frames; else it is gone
            pass
        self._bridge.lost()
        self._cells.put(None)

    def _route(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "exec":
            self._cells.put(message)
        elif isinstance(op, str) and op.startswith(("proc.", "ports.")):
            self._to_supervisor(message)
        else:
            self._bridge.deliver(message)

    def _to_supervisor(self, message: dict[str, Any]) -> None:
        """A request for the supervisor; answered here if there is none, or it has gone (a
        cell may have killed it where it runs as the session's user): the cells go on."""
        why = "no process supervisor"
        if self._supervisor is not None:
            body = _encoder.encode(message).encode("utf-8", "backslashreplace")
            try:
                with self._send_lock:
                    self._supervisor.sendall(_HEADER.pack(len(body)) + body)
                return
            except OSError:
                why = "the sandbox's process supervisor has ended (killed from inside?)"
        if "rid" in message:
            self._channel.send({"op": "proc.reply", "rid": message["rid"], "error": why})

    def _read_supervisor(self, supervisor: socket.socket) -> None:
        """Forward the supervisor's frames to the host as they are (it frames them itself)."""
        reader = supervisor.makefile("rb", buffering=1 << 16)
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
                if body != _HELLO:  # one that came after `await_supervisor` gave up
                    self._channel.send_frame(header + body)
        except OSError:
            return
        finally:
            reader.close()


def await_supervisor(supervisor: socket.socket | None, timeout_s: float = 30.0) -> None:
    """Wait for the supervisor's first frame (`framing.HELLO`: it has imported what it needs
    and serves), so that a sandbox is saved, for a pool's clones, only with a supervisor
    that is up, and each clone does not import it again. Gone or silent: on without it."""
    if supervisor is None:
        return
    ready, _, _ = select.select([supervisor], [], [], timeout_s)
    if ready:  # its first send, whole; or its end, which the router's reader finds too
        supervisor.recv(_HEADER.size + len(_HELLO), socket.MSG_WAITALL)


def drop_privileges(uid: int, gid: int, home: str) -> None:
    """Become the session's user for good (the kernel runs cells as it)."""
    os.setgroups([gid])
    os.setgid(gid)
    os.setuid(uid)
    try:
        os.chdir(home)
    except OSError:
        pass
