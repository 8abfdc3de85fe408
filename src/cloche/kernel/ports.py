"""The sandbox's side of ports: the host reaches a server listening on the sandbox's loopback.

The sandbox has no network, and nothing outside can connect into it. The relay, which the
process supervisor (`procd`) serves in its own loop from the session's first port request
on, connects out instead, to the session's ports door (a unix socket of the host), and
keeps `spare` connections waiting there. The host takes one for each connection it wants
to make and writes one line on it:

    C <port>\\n   connect to the port on the sandbox's loopback (127.0.0.1, then ::1): the
                 relay answers `K\\n` and carries bytes both ways from then on, or
                 `E <errno> <why>\\n` and closes. What the host wrote after the line waits
                 for the server.
    L\\n          the TCP ports listened on: one line of JSON, {"ports": [8000, ...]}.

Each connection taken is replaced at once. Nothing connects to the host before the host
asks, over the kernel's channel (relayed by the kernel's router to the supervisor):

    {"op": "ports.open", "rid", "door", "spare"}   connect to the door; answered once the
                                                    spares are there (or why not)
    {"op": "ports.shut", "rid"}                     end every connection to the host and
                                                    connect no more (before a checkpoint:
                                                    gVisor can't save a socket connected to
                                                    the host), answered with how many ended

Answers go back as the supervisor's others do: {"op": "proc.reply", "rid", ...}. The relay
is off the cells' path: a cell that holds the kernel's GIL never delays a request. It is
no process of its own: each Python process a sandbox holds adds about its own size to the
sandbox's checkpoint, and a shut relay is dropped whole.
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import socket
import time

from .splicing import Splicer

SPARE = 4  # connections kept waiting at the door, unless the host asks for another number
_RETRY_S = 0.05  # after a door whose queue was full
_LINE_BYTES = 64  # a command line's longest
_LISTEN = "0A"  # a socket's state in /proc/net/tcp: TCP_LISTEN
_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def listening() -> list[int]:
    """The TCP ports something listens on in this network namespace (the sandbox's
    loopback: 127.0.0.1, ::1 and the wildcard addresses), from /proc/net/tcp and tcp6."""
    ports: set[int] = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as table:
                lines = table.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == _LISTEN:
                try:
                    ports.add(int(fields[1].rpartition(":")[2], 16))
                except ValueError:
                    continue
    return sorted(ports)


class Relay(Splicer):
    """The door's waiting connections, the connections being made to servers inside, and
    the joined pairs, in one selector: its owner waits on `fileno()` with whatever else it
    watches and calls `step()` when it is ready or `timeout()` has passed."""

    def __init__(self) -> None:
        super().__init__()
        self.door: str | None = None  # the host's ports door, while open
        self.spare = SPARE
        self.idle: set[socket.socket] = set()  # at the door, waiting for the host's line
        # Connections being made inside: (the door connection that asked, the port, the
        # addresses left to try).
        self.dialing: dict[socket.socket, tuple[socket.socket, int, list[str]]] = {}
        self.retry_at: float | None = None

    def fileno(self) -> int:
        """Readable when the relay has something to do."""
        return self.selector.fileno()

    def timeout(self) -> float | None:
        """Seconds until the relay must step though nothing is ready (None: never)."""
        return None if self.retry_at is None else max(0.0, self.retry_at - time.monotonic())

    def step(self, timeout: float | None = 0.0) -> None:
        """Do what is ready (waiting up to timeout for something to be)."""
        for key, _events in self.selector.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock in self.pipes:
                self.move(sock)
            elif sock in self.idle:
                self._on_line(sock)
            elif sock in self.dialing:
                self._on_dialed(sock)
        if self.retry_at is not None and time.monotonic() >= self.retry_at:
            self.retry_at = None
            self._fill()

    def close_all(self) -> int:
        """End everything and let go of the selector, for good; how many connections to
        servers inside ended."""
        ended = self.shut()
        self.selector.close()
        return ended

    # -- the host's requests ---------------------------------------------------------------

    def handle(self, message: dict[str, object]) -> dict[str, object]:
        """Do a `ports.*` request; its answer's fields.

        Raises:
            ValueError, OSError: refused or failed, with the reason.
        """
        op = message.get("op")
        if op == "ports.open":
            return self._open(str(message.get("door") or ""), message.get("spare"))
        if op == "ports.shut":
            return {"ended": self.shut()}
        raise ValueError(f"unknown request {op!r}")

    def _open(self, door: str, spare: object) -> dict[str, object]:
        if not door:
            raise ValueError("ports.open names no door")
        if self.door != door:
            self.shut()
        self.door = door
        if isinstance(spare, int) and 1 <= spare <= 64:
            self.spare = spare
        why = self._fill()
        if not self.idle:
            self.door = None
            raise OSError(f"the ports door {door} can't be reached: {why or 'no connection'}")
        return {"idle": len(self.idle)}

    def shut(self) -> int:
        """End every connection to the host, and make none until asked to open again."""
        self.door = None
        self.retry_at = None
        for sock in list(self.idle):
            self._drop_idle(sock)
        ended = 0
        for inside, (door, _, _) in list(self.dialing.items()):
            self._forget_dialing(inside)
            door.close()
            ended += 1
        return ended + self.end_all()

    # -- the door's waiting connections ----------------------------------------------------

    def _fill(self) -> str | None:
        """Connect to the door until `spare` connections wait there; why it stopped short,
        if it did (a full queue: tried again shortly; a door gone: not until reopened)."""
        while self.door is not None and len(self.idle) < self.spare:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(self.door)
            except BlockingIOError:  # the host's queue is full: it takes them as it can
                sock.close()
                self.retry_at = time.monotonic() + _RETRY_S
                return "the door's queue is full"
            except OSError as exc:  # closed by the host (or not yet open)
                sock.close()
                self.door = None
                return exc.strerror or str(exc)
            self.idle.add(sock)
            self.selector.register(sock, selectors.EVENT_READ)
        return None

    def _drop_idle(self, sock: socket.socket) -> None:
        self.idle.discard(sock)
        self.selector.unregister(sock)
        sock.close()

    def _on_line(self, sock: socket.socket) -> None:
        """The host wrote on a waiting connection: a command line, or EOF."""
        try:
            seen = sock.recv(_LINE_BYTES, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            seen = b""
        end = seen.find(b"\n")
        if end < 0 and len(seen) < _LINE_BYTES and seen:
            return  # the rest of the line is on its way
        self.idle.discard(sock)
        self.selector.unregister(sock)
        self._fill()  # another waits in its place
        if end < 0:  # closed by the host, or not a line of ours
            sock.close()
            return
        line = sock.recv(end + 1)[:-1].decode("ascii", "replace")
        command, _, argument = line.partition(" ")
        if command == "C" and argument.isdigit() and 0 < int(argument) < 65536:
            self._dial(sock, int(argument), ["127.0.0.1", "::1"])
        elif command == "L":
            self._answer(sock, _encoder.encode({"ports": listening()}))
        else:
            self._answer(sock, f"E {errno.EINVAL} not a request of cloche's: {line[:40]!r}")

    def _answer(self, door: socket.socket, line: str) -> None:
        """Send one line to the host and close the connection."""
        try:
            door.setblocking(True)
            door.settimeout(1.0)
            door.sendall(line.encode("utf-8", "backslashreplace") + b"\n")
        except OSError:
            pass
        door.close()

    # -- connections to servers inside -----------------------------------------------------

    def _dial(self, door: socket.socket, port: int, addresses: list[str]) -> None:
        """Connect to the first of addresses that takes a connection on port."""
        last = errno.ECONNREFUSED
        while addresses:
            address = addresses.pop(0)
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            try:
                inside = socket.socket(family, socket.SOCK_STREAM)
            except OSError as exc:  # no IPv6 here, say
                last = exc.errno or last
                continue
            inside.setblocking(False)
            code = inside.connect_ex((address, port))
            if code == 0:
                self._connected(door, inside)
                return
            if code in (errno.EINPROGRESS, errno.EAGAIN):
                self.dialing[inside] = (door, port, addresses)
                self.selector.register(inside, selectors.EVENT_WRITE)
                return
            inside.close()
            last = code
        why = "nothing listens on it" if last == errno.ECONNREFUSED else os.strerror(last)
        self._answer(door, f"E {last} port {port}: {why}")

    def _on_dialed(self, inside: socket.socket) -> None:
        door, port, addresses = self.dialing[inside]
        self._forget_dialing(inside)
        code = inside.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code == 0:
            self._connected(door, inside)
            return
        inside.close()
        if addresses:
            self._dial(door, port, addresses)
        else:
            why = "nothing listens on it" if code == errno.ECONNREFUSED else os.strerror(code)
            self._answer(door, f"E {code} port {port}: {why}")

    def _forget_dialing(self, inside: socket.socket) -> None:
        del self.dialing[inside]
        self.selector.unregister(inside)

    def _connected(self, door: socket.socket, inside: socket.socket) -> None:
        try:
            door.send(b"K\n")  # a fresh connection's buffer has room for it
        except OSError:
            door.close()
            inside.close()
            return
        self.join(inside, door)
