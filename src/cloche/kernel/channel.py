"""The kernel's side of its channel to the host: length-prefixed JSON over two fds.

The host hands the channel over as fds 0 and 1. The kernel moves it to other fds at
start-up, so that fds 0/1/2 of the user's code are its own (stdin at /dev/null, stdout
and stderr into pipes the kernel reads). The framing is the host's
(`cloche.protocol.framing`): a 4-byte big-endian length, then UTF-8 JSON.

Messages, host -> kernel:  {"op": "exec", "code": str, "output_limit": int}
                           {"op": "proc.link", "path", "token"}: passed on to the process
                           supervisor (`procd`), which then talks to the host directly
Messages, kernel -> host:  {"op": "ready", "pid": int}
                           {"op": "stream", "name": "stdout"|"stderr", "text": str}
                           {"op": "display", "data": {mime: value}}
                           {"op": "done", "status": "ok"|"error", "result": ..., ...}
                           {"op": "proc.gone", "why": str}: no supervisor to link
"""

from __future__ import annotations

import io
import json
import os
import struct
import threading
from typing import Any

HEADER = struct.Struct(">I")

# A lone surrogate (a str such as '\ud800', which user code can make) can't be UTF-8;
# it only ever appears inside a JSON string, where backslashreplace writes it as the
# JSON escape \ud800, so the body stays valid UTF-8 and decodes to the same str.
_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


class Channel:
    """Frames in from one fd, frames out to another; sends are thread-safe."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._reader = io.open(read_fd, "rb", buffering=1 << 16)  # noqa: UP020
        self._write_fd = write_fd
        self._send_lock = threading.Lock()

    @classmethod
    def take_stdio(cls) -> Channel:
        """Move the host's channel off fds 0 and 1, and put /dev/null on fd 0."""
        read_fd = os.dup(0)  # os.dup makes the copy non-inheritable: children don't get it
        write_fd = os.dup(1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        return cls(read_fd, write_fd)

    def recv(self) -> dict[str, Any] | None:
        """The next message from the host, or None when the host has gone."""
        header = self._reader.read(HEADER.size)
        if len(header) < HEADER.size:
            return None
        (length,) = HEADER.unpack(header)
        body = self._reader.read(length)
        if len(body) < length:
            return None
        message: dict[str, Any] = json.loads(body)
        return message

    def send(self, message: dict[str, Any]) -> None:
        """Write one frame, whole, even if a signal interrupts the write."""
        body = _encoder.encode(message).encode("utf-8", "backslashreplace")
        frame = memoryview(HEADER.pack(len(body)) + body)
        with self._send_lock:
            while frame:
                frame = frame[os.write(self._write_fd, frame) :]
