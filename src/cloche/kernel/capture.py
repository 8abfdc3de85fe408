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
import time
from typing import TextIO

from .channel import Channel

_CHUNK = 1 << 16
# After forwarding, the pump waits this long before it reads again: output written
# meanwhile goes in one message, not one per line, and a cell printing flat out fills the
# pipe and waits on it (backpressure) instead of costing the host a message per line.
# Past the byte budget nothing is forwarded, so the pump reads on without a pause: what
# is dropped costs the host nothing, and a cell writing far past its budget is not held
# up until its timeout. A cell's end still drains all.
_PUMP_PAUSE_S = 0.01
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
        self._by_fd = {stream.read_fd: stream for stream in self._streams}
        self._ready = select.epoll()  # the main thread's check at the end of a cell
        for stream in self._streams:
            self._ready.register(stream.read_fd, select.EPOLLIN)
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
        """Reset the byte budget for a new cell."""
        with self._lock:
            self.limit_bytes = limit_bytes
            self.sent_bytes = 0
            self.dropped_bytes = 0

    def repair(self) -> None:
        """Put fds 1/2 and sys.stdout/stderr back if a cell broke them.

        Called after a cell's end marker has gone out, so that it costs the cell nothing:
        each system call inside gVisor takes tens of microseconds.
        """
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
        for stream in (self.stdout, self.stderr):
            self._flush(stream)
        if sys.stdout is not self.stdout:
            self._flush(sys.stdout)
        if sys.stderr is not self.stderr:
            self._flush(sys.stderr)
        with self._lock:
            # One system call when nothing is waiting, which is the common case.
            for fd, _ in self._ready.poll(0):
                self._drain(self._by_fd[fd])
            return self.dropped_bytes

    @staticmethod
    def _flush(stream: TextIO) -> None:
        try:
            stream.flush()
        except Exception:  # noqa: S110  # the cell may have broken its own streams
            pass

    def _pump(self) -> None:
        poller = select.epoll()
        for stream in self._streams:
            poller.register(stream.read_fd, select.EPOLLIN)
        while True:
            ready = poller.poll()
            with self._lock:
                sent = [self._drain(self._by_fd[fd]) for fd, _ in ready]
            if any(sent):
                time.sleep(_PUMP_PAUSE_S)

    def _drain(self, stream: _Stream) -> bool:
        """Read the pipe empty; return whether anything was forwarded."""
        sent = False
        while True:
            try:
                data = os.read(stream.read_fd, _CHUNK)
            except BlockingIOError:
                return sent
            if data:
                sent = self._forward(stream, data) or sent
            if len(data) < _CHUNK:  # the pipe held less than asked for: it is empty now
                return sent

    def _forward(self, stream: _Stream, data: bytes) -> bool:
        room = self.limit_bytes - self.sent_bytes
        if len(data) > room:
            self.dropped_bytes += len(data) - max(room, 0)
            data = data[: max(room, 0)]
            if not data:
                return False
        self.sent_bytes += len(data)
        text = stream.decoder.decode(data)
        if text:
            self._channel.send({"op": "stream", "name": stream.name, "text": text})
        return True
