"""Two sockets joined inside the sandbox: a connection of its loopback and one to a door of
the host, their bytes spliced through a kernel pipe each way, never through Python (each
copy was a third of the time), in one selector with whatever else a relay watches.

Egress's relay (`egress`) and the ports' relay (`ports`) both join such pairs. The door's
side is the host's: once the host has said EOF the pair is closed (the host is done), and a
pair whose both sides have said EOF is closed too.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import socket

BUFFER_BYTES = 1024 * 1024  # a pipe's size: read no more from one side while it is full
_F_SETPIPE_SZ, _F_GETPIPE_SZ = 1031, 1032  # fcntl's, on Linux
_NOW = {"flags": 0x1 | 0x2}  # SPLICE_F_MOVE | SPLICE_F_NONBLOCK


class Pipe:
    """One direction of a connection: bytes spliced from `source` into a kernel pipe wait
    there for `sink`."""

    def __init__(self, source: socket.socket, sink: socket.socket) -> None:
        self.source = source
        self.sink = sink
        self.out, self.into = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self.room = fcntl.fcntl(self.into, _F_SETPIPE_SZ, BUFFER_BYTES)
        except OSError:  # the pipe keeps its default size
            self.room = fcntl.fcntl(self.into, _F_GETPIPE_SZ)
        self.waiting = 0  # bytes in the pipe
        self.from_door = source.family == socket.AF_UNIX  # bytes the host sends
        self.ended = False  # the source said EOF (or failed)
        self.eof_sent = False  # ... and the sink was told, once all had been sent

    def fill(self) -> None:
        """Move what the source has into the pipe (EOF or an error: ended)."""
        try:
            moved = os.splice(self.source.fileno(), self.into, self.room - self.waiting, **_NOW)
        except BlockingIOError:
            return
        except OSError:
            moved = 0
        if moved == 0:
            self.ended = True
        self.waiting += moved

    def drain(self) -> None:
        """Move what waits in the pipe to the sink, as far as it takes it (OSError: the
        sink failed)."""
        try:
            self.waiting -= os.splice(self.out, self.sink.fileno(), self.waiting, **_NOW)
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.out)
        os.close(self.into)


class Splicer:
    """Joined pairs of sockets in one selector (a relay's, which may watch more)."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.pipes: dict[socket.socket, tuple[Pipe, Pipe]] = {}  # by socket: (from, to)
        self.events: dict[socket.socket, int] = {}  # what the selector watches, by socket

    def join(self, inside: socket.socket, door: socket.socket) -> None:
        """Carry bytes both ways between a loopback connection and a door connection (both
        non-blocking) until the host is done or both sides have said EOF."""
        # Small writes (a TLS handshake's, a request's head) go at once: with Nagle's
        # algorithm and the peer's delayed ACK, each waited ~40 ms.
        inside.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out, back = Pipe(inside, door), Pipe(door, inside)
        self.pipes[inside] = (out, back)
        self.pipes[door] = (back, out)
        self.watch(inside)
        self.watch(door)

    @property
    def joined(self) -> int:
        """The number of pairs carried now."""
        return len(self.pipes) // 2

    def end_all(self) -> int:
        """Close every pair; how many there were."""
        count = self.joined
        for end in list(self.pipes):
            self.close(end)
        return count

    def move(self, sock: socket.socket) -> None:
        """One of a pair's sockets is ready: move what can be moved."""
        reading, writing = self.pipes[sock]
        if not reading.ended and reading.waiting < reading.room:
            reading.fill()
            self._flush(reading)
        if sock in self.pipes:
            self._flush(writing)
        if sock in self.pipes:
            self.watch(sock)

    def _flush(self, pipe: Pipe) -> None:
        """Send what waits for pipe's sink; pass the EOF on once all is sent."""
        if pipe.waiting:
            try:
                pipe.drain()
            except OSError:
                self.close(pipe.sink)
                return
        if pipe.ended and not pipe.waiting and not pipe.eof_sent:
            pipe.eof_sent = True
            try:
                pipe.sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        if pipe.eof_sent and pipe.from_door:  # the host is done: so is the connection
            self.close(pipe.sink)
            return
        if pipe.eof_sent:
            other = self.pipes.get(pipe.sink)
            if other is not None and other[0].ended and not other[0].waiting:
                self.close(pipe.sink)
        if pipe.sink in self.pipes:
            self.watch(pipe.sink)
        if pipe.source in self.pipes:  # room again: read its source again
            self.watch(pipe.source)

    def watch(self, sock: socket.socket) -> None:
        """Read while there is room; write while something waits (a change of the selector
        only when the events change: each is a system call of gVisor's)."""
        reading, writing = self.pipes[sock]
        events = 0
        if not reading.ended and reading.waiting < reading.room:
            events |= selectors.EVENT_READ
        if writing.waiting:
            events |= selectors.EVENT_WRITE
        was = self.events.get(sock, 0)
        if events == was:
            return
        try:
            if events and was:
                self.selector.modify(sock, events)
            elif events:
                self.selector.register(sock, events)
            else:
                self.selector.unregister(sock)
        except (KeyError, ValueError, OSError):
            self.close(sock)
            return
        self.events[sock] = events

    def close(self, sock: socket.socket) -> None:
        """Close a pair: both of its sockets and both of its pipes."""
        pair = self.pipes.get(sock)
        if pair is None:
            return
        for end in (pair[0].source, pair[0].sink):
            self.pipes.pop(end, None)
            if self.events.pop(end, 0):
                self.selector.unregister(end)
            end.close()
        for pipe in pair:
            pipe.close()
