"""The sandbox's side of egress: a proxy address on its loopback, carried to the host's door.

The sandbox has no network. A session given egress has a door: a unix socket the host
listens on, at `DOOR` in the sandbox. `open_door` listens on 127.0.0.1:PORT and carries each
connection's bytes to and from a connection of its own to the door, in one thread (threads
count against the session's process limit), and sets the proxy variables, so `urllib`,
`requests`, `httpx`, `pip` and `git` (and the commands a cell runs) go through it. The host
decides what passes.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import socket
import threading

DOOR = "/run/cloche/door.sock"
CA_BUNDLE = "/run/cloche/ca.pem"  # the CAs an https client here trusts, when present
PORT = 3128
_BUFFER_BYTES = 1024 * 1024  # a pipe's size: read no more from one side while it is full
_REFUSAL_LINGER_S = 1.0  # at most, for a refused client to read its answer and close
_F_SETPIPE_SZ, _F_GETPIPE_SZ = 1031, 1032  # fcntl's, on Linux
_NOW = {"flags": 0x1 | 0x2}  # SPLICE_F_MOVE | SPLICE_F_NONBLOCK
_relay: _Relay | None = None
_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
_CA_VARIABLES = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "PIP_CERT",
    "GIT_SSL_CAINFO",
)


def open_door(
    port: int = PORT,
    door: str = DOOR,
    ca_bundle: str = CA_BUNDLE,
    env: dict[str, str] | None = None,
) -> str:
    """Listen for proxy connections (once) and point the proxy variables at them; `env`
    holds the session's secrets' placeholders (the proxy puts the values in)."""
    global _relay
    if _relay is None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
        listener.setblocking(False)
        _relay = _Relay(listener, door)
        threading.Thread(target=_relay.run, name="cloche-egress", daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    for name in _PROXY_VARIABLES:
        os.environ[name] = os.environ[name.lower()] = url
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "localhost,127.0.0.1,::1"
    if os.path.exists(ca_bundle):
        for name in _CA_VARIABLES:
            os.environ[name] = ca_bundle
    os.environ.update(env or {})
    return url


def drop_connections(timeout_s: float = 10.0) -> int:
    """End every connection in flight (before a checkpoint: gVisor cannot save a socket
    connected to the host); the number ended. New ones are taken as before."""
    if _relay is None:
        return 0
    return _relay.drop(timeout_s)


class _Pipe:
    """One direction of a connection: bytes spliced from `source` into a kernel pipe wait
    there for `sink` (never copied through Python: each copy was a third of the time)."""

    def __init__(self, source: socket.socket, sink: socket.socket) -> None:
        self.source = source
        self.sink = sink
        self.out, self.into = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self.room = fcntl.fcntl(self.into, _F_SETPIPE_SZ, _BUFFER_BYTES)
        except OSError:  # the pipe keeps its default size
            self.room = fcntl.fcntl(self.into, _F_GETPIPE_SZ)
        self.waiting = 0  # bytes in the pipe
        self.from_door = source.family == socket.AF_UNIX  # bytes the host sends back
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


class _Relay:
    """Every connection to the listener, paired with one to the door, in one selector."""

    def __init__(self, listener: socket.socket, door: str) -> None:
        self.listener = listener
        self.door = door
        self.selector = selectors.DefaultSelector()
        self.pipes: dict[socket.socket, tuple[_Pipe, _Pipe]] = {}  # by socket: (from, to)
        self.events: dict[socket.socket, int] = {}  # what the selector watches for, by socket
        # drop(), from another thread: a byte on the waker; the relay ends every connection
        # and says how many on `dropped`.
        self._waker, self._wake = socket.socketpair()
        self._lock = threading.Lock()
        self._dropped: list[int] = []
        self._done = threading.Event()

    def drop(self, timeout_s: float) -> int:
        return self._ask(b"x", timeout_s)

    def stop(self, timeout_s: float = 10.0) -> int:
        """End every connection and stop listening (run returns); the number ended."""
        return self._ask(b"s", timeout_s)

    def _ask(self, what: bytes, timeout_s: float) -> int:
        """Have the relay's thread end every connection (and stop, for b"s")."""
        with self._lock:
            self._done.clear()
            self._wake.send(what)
            if not self._done.wait(timeout_s):
                raise TimeoutError("the egress relay did not end its connections")
            return self._dropped.pop()

    def _end(self) -> None:
        self.selector.close()
        for sock in (self.listener, self._waker, self._wake):
            sock.close()

    def run(self) -> None:
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self._waker, selectors.EVENT_READ)
        while True:
            for key, _events in self.selector.select():
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.listener:
                    self._accept()
                elif sock is self._waker:
                    asked = self._waker.recv(64)
                    count = len(self.pipes) // 2
                    for end in list(self.pipes):
                        self._close(end)
                    self._dropped.append(count)
                    if b"s" in asked:  # stop(): listen no more
                        self._end()
                        self._done.set()
                        return
                    self._done.set()
                elif sock in self.pipes:
                    self._move(sock)

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        try:
            door = self._connect()
        except OSError as exc:
            _refuse(client, f"the session's egress door is closed ({exc.strerror})")
            return
        # Small writes (a TLS handshake's) go at once: with Nagle's algorithm and the
        # client's delayed ACK, each waited ~40 ms (an https request took 39 ms, not 2).
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client.setblocking(False)
        out, back = _Pipe(client, door), _Pipe(door, client)
        self.pipes[client] = (out, back)
        self.pipes[door] = (back, out)
        self._watch(client)
        self._watch(door)

    def _connect(self) -> socket.socket:
        door = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            door.connect(self.door)
        except OSError:
            door.close()
            raise
        door.setblocking(False)
        return door

    def _move(self, sock: socket.socket) -> None:
        reading, writing = self.pipes[sock]
        if not reading.ended and reading.waiting < reading.room:
            reading.fill()
            self._flush(reading)
        if sock in self.pipes:
            self._flush(writing)
        if sock in self.pipes:
            self._watch(sock)

    def _flush(self, pipe: _Pipe) -> None:
        """Send what waits for pipe's sink; pass the EOF on once all is sent."""
        if pipe.waiting:
            try:
                pipe.drain()
            except OSError:
                self._close(pipe.sink)
                return
        if pipe.ended and not pipe.waiting and not pipe.eof_sent:
            pipe.eof_sent = True
            try:
                pipe.sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        if pipe.eof_sent and pipe.from_door:  # the host is done: so is the connection
            self._close(pipe.sink)
            return
        if pipe.eof_sent:
            other = self.pipes.get(pipe.sink)
            if other is not None and other[0].ended and not other[0].waiting:
                self._close(pipe.sink)
        if pipe.sink in self.pipes:
            self._watch(pipe.sink)
        if pipe.source in self.pipes:  # room again: read its source again
            self._watch(pipe.source)

    def _watch(self, sock: socket.socket) -> None:
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
            self._close(sock)
            return
        self.events[sock] = events

    def _close(self, sock: socket.socket) -> None:
        """Close a connection: both of its sockets and both of its pipes."""
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


def _refuse(client: socket.socket, why: str) -> None:
    body = f"{why}\n".encode()
    head = (
        "HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    client.settimeout(_REFUSAL_LINGER_S)
    try:
        client.sendall(head.encode() + body)
        # Read what the client sent until it closes: closed with its request unread, the
        # connection would be reset, and the client might never read the answer.
        client.shutdown(socket.SHUT_WR)
        while client.recv(65536):
            pass
    except OSError:
        pass
    client.close()
