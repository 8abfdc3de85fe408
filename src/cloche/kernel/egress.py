"""The sandbox's side of egress: a proxy address on its loopback, carried to the host's door.

The sandbox has no network. A session given egress has a door: a unix socket the host
listens on, at `DOOR` in the sandbox. `open_door` listens on 127.0.0.1:PORT and carries each
connection's bytes to and from a connection of its own to the door, in one thread (threads
count against the session's process limit), and sets the proxy variables, so `urllib`,
`requests`, `httpx`, `pip` and `git` (and the commands a cell runs) go through it. The host
decides what passes.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import threading

DOOR = "/run/cloche/door.sock"
CA_BUNDLE = "/run/cloche/ca.pem"  # the CAs an https client here trusts, when present
PORT = 3128
_BUFFER_BYTES = 1024 * 1024  # read no more from one side while this much waits for the other
_READ_BYTES = 256 * 1024  # one read: each is a system call of gVisor's
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
    """One direction of a connection: bytes read from `source` wait here for `sink`."""

    def __init__(self, source: socket.socket, sink: socket.socket) -> None:
        self.source = source
        self.sink = sink
        self.waiting = bytearray()
        self.from_door = source.family == socket.AF_UNIX  # bytes the host sends back
        self.ended = False  # the source said EOF (or failed)
        self.eof_sent = False  # ... and the sink was told, once all had been sent


class _Relay:
    """Every connection to the listener, paired with one to the door, in one selector."""

    def __init__(self, listener: socket.socket, door: str) -> None:
        self.listener = listener
        self.door = door
        self.selector = selectors.DefaultSelector()
        self.pipes: dict[socket.socket, tuple[_Pipe, _Pipe]] = {}  # by socket: (from, to)
        # drop(), from another thread: a byte on the waker; the relay ends every connection
        # and says how many on `dropped`.
        self._waker, self._wake = socket.socketpair()
        self._lock = threading.Lock()
        self._dropped: list[int] = []
        self._done = threading.Event()

    def drop(self, timeout_s: float) -> int:
        with self._lock:
            self._done.clear()
            self._wake.send(b"x")
            if not self._done.wait(timeout_s):
                raise TimeoutError("the egress relay did not end its connections")
            return self._dropped.pop()

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
                    self._waker.recv(64)
                    count = len(self.pipes) // 2
                    for end in list(self.pipes):
                        self._close(end)
                    self._dropped.append(count)
                    self._done.set()
                elif sock in self.pipes:
                    self._move(sock)

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        door = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            door.connect(self.door)
        except OSError as exc:
            _refuse(client, f"the session's egress door is closed ({exc.strerror})")
            door.close()
            return
        # Small writes (a TLS handshake's) go at once: with Nagle's algorithm and the
        # client's delayed ACK, each waited ~40 ms (an https request took 39 ms, not 2).
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client.setblocking(False)
        door.setblocking(False)
        out, back = _Pipe(client, door), _Pipe(door, client)
        self.pipes[client] = (out, back)
        self.pipes[door] = (back, out)
        self._watch(client)
        self._watch(door)

    def _move(self, sock: socket.socket) -> None:
        reading, writing = self.pipes[sock]
        if not reading.ended and len(reading.waiting) < _BUFFER_BYTES:
            try:
                data = sock.recv(_READ_BYTES)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                reading.ended = True
            elif data:
                reading.waiting += data
            self._flush(reading)
        if sock in self.pipes:
            self._flush(writing)
        if sock in self.pipes:
            self._watch(sock)

    def _flush(self, pipe: _Pipe) -> None:
        """Send what waits for pipe's sink; pass the EOF on once all is sent."""
        if pipe.waiting:
            try:
                sent = pipe.sink.send(pipe.waiting)
                del pipe.waiting[:sent]
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno != errno.EAGAIN:
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
        """Read while there is room; write while something waits."""
        reading, writing = self.pipes[sock]
        events = 0
        if not reading.ended and len(reading.waiting) < _BUFFER_BYTES:
            events |= selectors.EVENT_READ
        if writing.waiting:
            events |= selectors.EVENT_WRITE
        registered = _registered(self.selector, sock)
        try:
            if events and registered:
                self.selector.modify(sock, events)
            elif events:
                self.selector.register(sock, events)
            elif registered:
                self.selector.unregister(sock)
        except (KeyError, ValueError, OSError):
            self._close(sock)

    def _close(self, sock: socket.socket) -> None:
        """Close a connection: both of its sockets."""
        pair = self.pipes.get(sock)
        if pair is None:
            return
        for end in (pair[0].source, pair[0].sink):
            self.pipes.pop(end, None)
            if _registered(self.selector, end):
                self.selector.unregister(end)
            end.close()


def _registered(selector: selectors.BaseSelector, sock: socket.socket) -> bool:
    try:
        selector.get_key(sock)
    except KeyError:
        return False
    return True


def _refuse(client: socket.socket, why: str) -> None:
    body = f"{why}\n".encode()
    head = (
        "HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    try:
        client.sendall(head.encode() + body)
    except OSError:
        pass
    client.close()
