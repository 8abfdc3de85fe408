"""The kernel's side of its process supervisor (`procd`): its hello, and the host's asks
for its link.

The host's frames all come to the kernel, on its channel, and the kernel reads them itself:
between cells in its serve loop, during a cell in the callers that wait for a reply
(`llm.Bridge`). Only one of them is not the kernel's: `proc.link`, which the host sends
after a start and after each restore, between cells (one asked for again after a link ended
unasked may come during a cell: it is passed on when the cell reads the channel for a reply,
or once it ends). The kernel passes it on to the supervisor, which then connects to the
host through the sandbox's door and talks to it directly (`framing.HostLink`): commands,
terminals and the ports' relay never wait on a cell, and a cell never waits on a thread.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
from typing import Any

from .channel import Channel
from .framing import HELLO

_HEADER = struct.Struct(">I")
_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_HELLO = _encoder.encode(HELLO).encode()  # as the supervisor sends it (`framing`)
_GONE = "the sandbox's process supervisor has ended (killed from inside?)"


class Router:
    """Passes the host's `proc.link` on to the supervisor; drops what else is not a cell's
    (a reply to a call its cell gave up on)."""

    def __init__(self, channel: Channel, supervisor: socket.socket | None) -> None:
        self._channel = channel
        self._supervisor = supervisor

    def route(self, message: dict[str, Any]) -> None:
        if message.get("op") != "proc.link":
            return
        why = "no process supervisor"
        if self._supervisor is not None:
            body = _encoder.encode(message).encode("utf-8", "backslashreplace")
            try:
                self._supervisor.sendall(_HEADER.pack(len(body)) + body)
                return
            except OSError:
                why = _GONE
        self._channel.send({"op": "proc.gone", "why": why})  # commands fail with it


def await_supervisor(supervisor: socket.socket | None, timeout_s: float = 30.0) -> None:
    """Wait for the supervisor's first frame (`framing.HELLO`: it has imported what it needs
    and serves), so that a sandbox is saved, for a pool's clones, only with a supervisor
    that is up, and each clone does not import it again. Gone or silent: on without it."""
    if supervisor is None:
        return
    ready, _, _ = select.select([supervisor], [], [], timeout_s)
    if ready:  # its first send, whole; or its end
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
