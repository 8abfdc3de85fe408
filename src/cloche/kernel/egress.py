"""The sandbox's side of egress: a proxy address on its loopback, carried to the host's door.

The sandbox has no network. A session given egress has a door: a unix socket the host
listens on, at `DOOR` in the sandbox. `open_door` listens on 127.0.0.1:PORT and carries each
connection's bytes to and from a connection of its own to the door, in one thread (threads
count against the session's process limit), and sets the proxy variables, so `urllib`,
`requests`, `httpx`, `pip` and `git` (and the commands a cell runs) go through it. The host
decides what passes.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading

from .splicing import Splicer

DOOR = "/run/cloche/door.sock"
CA_BUNDLE = "/run/cloche/ca.pem"  # the CAs an https client here trusts, when present
PORT = 3128
_REFUSAL_LINGER_S = 1.0  # at most, for a refused client to read its answer and close
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


class _Relay(Splicer):
    """Every connection to the listener, joined to one to the door, in one selector."""

    def __init__(self, listener: socket.socket, door: str) -> None:
        super().__init__()
        self.listener = listener
        self.door = door
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
                    self._dropped.append(self.end_all())
                    if b"s" in asked:  # stop(): listen no more
                        self._end()
                        self._done.set()
                        return
                    self._done.set()
                elif sock in self.pipes:
                    self.move(sock)

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
        client.setblocking(False)
        self.join(client, door)  # (an https request took 39 ms, not 2, with Nagle's)

    def _connect(self) -> socket.socket:
        door = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            door.connect(self.door)
        except OSError:
            door.close()
            raise
        door.setblocking(False)
        return door


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
