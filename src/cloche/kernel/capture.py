"""Output capture at the file-descriptor level.

fds 1 and 2 become the write ends of two pipes that the kernel reads, so that output
written below `sys.stdout` (C extensions, `os.write`, subprocesses) is captured too, and
nothing the cell writes can reach the host's channel directly. A pump thread forwards
output as it arrives; at the end of a cell the main thread drains what is left, so every
byte written before the cell ended is reported before the cell's end marker.
"""

from __future__ import annotations

import codecs
import io
import os
import select
import sys
import threading
from typing import TextIO

from .channel import Channel

_CHUNK = 1 << 16
# Spare copies of the pipes' write ends live at these fds, to repair fds 1/2 if a cell
# closes them. High numbers keep them out of the way of the user's own fds.
_SPARE_FDS = (1021, 1022)


class _Stream:
    def __init__(self, name: str, read_fd: int) -> None:
        self.name = name
        self.read_fd = read_fd
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")


class OutputCapture:
    """Forwards what is written to fds 1 and 2 as `stream` messages, within a byte budget."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self._streams: list[_Stream] = []
        for fd, name, spare in ((1, "stdout", _SPARE_FDS[0]), (2, "stderr", _SPARE_FDS[1])):
            read_fd, write_fd = os.pipe()
            os.set_blocking(read_fd, False)
            os.dup2(write_fd, fd)
            os.dup2(write_fd, spare, inheritable=False)
            os.close(write_fd)
            self._streams.append(_Stream(name, read_fd))
        self.limit_bytes = 1 << 20
        self.sent_bytes = 0
        self.dropped_bytes = 0
        self.stdout = self._text_stream(1)
        self.stderr = self._text_stream(2)
        sys.stdout, sys.stderr = self.stdout, self.stderr
        threading.Thread(target=self._pump, name="cloche-output", daemon=True).start()

    @staticmethod
    def _text_stream(fd: int) -> TextIO:
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(
            io.BufferedWriter(raw), encoding="utf-8", errors="backslashreplace", line_buffering=True
        )

    def begin_cell(self, limit_bytes: int) -> None:
        """Reset the budget, and repair fds 1/2 and sys.stdout/stderr if a cell broke them."""
        with self._lock:
            self.limit_bytes = limit_bytes
            self.sent_bytes = 0
            self.dropped_bytes = 0
        os.dup2(_SPARE_FDS[0], 1)
        os.dup2(_SPARE_FDS[1], 2)
        if self.stdout.closed:
            self.stdout = self._text_stream(1)
            sys.stdout = self.stdout
        if self.stderr.closed:
            self.stderr = self._text_stream(2)
            sys.stderr = self.stderr

    def end_cell(self) -> int:
        """Flush and forward everything written so far; return the bytes dropped."""
        for stream in {
            id(s): s for s in (self.stdout, self.stderr, sys.stdout, sys.stderr)
        }.values():
            try:
                stream.flush()
            except Exception:  # noqa: S110  # the cell may have broken its own streams
                pass
        with self._lock:
            self._drain()
            return self.dropped_bytes

    def _pump(self) -> None:
        poller = select.poll()
        for stream in self._streams:
            poller.register(stream.read_fd, select.POLLIN)
        while True:
            poller.poll()
            with self._lock:
                self._drain()

    def _drain(self) -> None:
        for stream in self._streams:
            while True:
                try:
                    data = os.read(stream.read_fd, _CHUNK)
                except BlockingIOError:
                    break
                if not data:
                    break
                self._forward(stream, data)

    def _forward(self, stream: _Stream, data: bytes) -> None:
        room = self.limit_bytes - self.sent_bytes
        if len(data) > room:
            self.dropped_bytes += len(data) - max(room, 0)
            data = data[: max(room, 0)]
            if not data:
                return
        self.sent_bytes += len(data)
        text = stream.decoder.decode(data)
        if text:
            self._channel.send({"op": "stream", "name": stream.name, "text": text})
