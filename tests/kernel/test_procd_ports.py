"""The process supervisor serves the ports' relay in its own loop, and lets its spare leader
go before a checkpoint: unit tests of `cloche.kernel.procd` run as a process of the host
(no sandbox: the loop and its frames; the sandboxed path is in tests/server/test_ports.py).

Each Python process a sandbox holds adds about its own size to the sandbox's checkpoint,
so the supervisor must not fork a relay, and must keep no spare leader into an image."""

from __future__ import annotations

import base64
import getpass
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cloche.kernel.framing import HELLO
from cloche.kernel.router import await_supervisor
from cloche.sessions.supervisor_link import SOCKET as SUPERVISOR_DOOR

HEADER = struct.Struct(">I")
DEADLINE_S = 30.0


class Supervisor:
    """procd in a process of its own: its kernel's socket, and its link to the host, which
    connects to a door listened on here (as `cloche.sessions.supervisor_link` does)."""

    def __init__(self, door_dir: Path) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import socket, sys\n"
                "from cloche.kernel import procd\n"
                "procd.run(socket.socket(fileno=int(sys.argv[1])))",
                str(theirs.fileno()),
            ],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.kernel = ours
        self.kernel.settimeout(DEADLINE_S)
        self.door = str(door_dir / SUPERVISOR_DOOR)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        directory = os.open(door_dir, os.O_RDONLY | os.O_DIRECTORY)  # a path of any length
        try:
            self.listener.bind(f"/proc/self/fd/{directory}/{SUPERVISOR_DOOR}")
        finally:
            os.close(directory)
        self.listener.listen(4)
        self.listener.settimeout(DEADLINE_S)
        self.link: socket.socket | None = None
        self.reader: Any = None
        self.rids = iter(range(1, 1 << 30))
        self.frames: list[dict[str, Any]] = []  # not yet looked at

    def connect(self, token: str = "first") -> dict[str, Any]:  # noqa: S107  # a test's
        """Ask for the link through the kernel's socket, as the kernel passes it on; the
        first frame that comes through it."""
        _send(self.kernel, {"op": "proc.link", "path": self.door, "token": token})
        self.link = self.listener.accept()[0]
        self.link.settimeout(DEADLINE_S)
        self.reader = self.link.makefile("rb")
        return self.next()

    def ask(self, op: str, **fields: Any) -> dict[str, Any]:
        rid = next(self.rids)
        self.send({"op": op, "rid": rid, **fields})
        return self.until(lambda f: f.get("op") == "proc.reply" and f.get("rid") == rid)

    def send(self, message: dict[str, Any]) -> None:
        assert self.link is not None
        _send(self.link, message)

    def next(self) -> dict[str, Any]:
        header = self.reader.read(HEADER.size)
        assert len(header) == HEADER.size, "the supervisor ended the link"
        frame: dict[str, Any] = json.loads(self.reader.read(HEADER.unpack(header)[0]))
        return frame

    def until(self, wanted: Any) -> dict[str, Any]:
        for frame in self.frames:
            if wanted(frame):
                self.frames.remove(frame)
                return frame
        while True:
            frame = self.next()
            if wanted(frame):
                return frame
            self.frames.append(frame)

    def children(self) -> list[int]:
        """The supervisor's child processes (zombies too)."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.process.pid:
                found.append(int(entry))
        return found

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.link.close()  # type: ignore[union-attr]
        self.listener.close()
        self.kernel.close()  # the supervisor exits once its kernel has gone
        try:
            self.process.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    sock.sendall(HEADER.pack(len(body)) + body)


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    running = Supervisor(tmp_path)
    try:
        await_supervisor(running.kernel)
        assert running.connect() == {**HELLO, "token": "first"}
        yield running
    finally:
        running.close()


@pytest.fixture
def door(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A ports door, as the host listens on it."""
    path = tmp_path / "ports.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    listener.settimeout(DEADLINE_S)
    try:
        yield str(path), listener
    finally:
        listener.close()


@pytest.fixture
def echo() -> Iterator[int]:
    """A TCP echo server on the host's loopback; its port."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


def test_the_relay_is_served_by_the_supervisor_itself(supervisor, door, echo):
    path, listener = door
    assert supervisor.ask("ports.shut") == {"op": "proc.reply", "rid": 1, "ended": 0}
    opened = supervisor.ask("ports.open", door=path, spare=2)
    assert opened.get("idle") == 2, opened
    assert supervisor.children() == []  # no process of its own
    waiting = [listener.accept()[0] for _ in range(2)]
    for sock in waiting:
        sock.settimeout(DEADLINE_S)

    first = waiting[0]
    first.sendall(b"C %d\n" % echo)
    assert first.recv(2) == b"K\n"
    first.sendall(b"through the relay")
    assert _read(first, 17) == b"through the relay"
    replacement = listener.accept()[0]  # another waits in the taken one's place
    replacement.settimeout(DEADLINE_S)

    waiting[1].sendall(b"L\n")
    assert echo in json.loads(_read_line(waiting[1]))["ports"]

    shut = supervisor.ask("ports.shut")
    assert shut.get("ended") == 1, shut  # the joined pair
    assert first.recv(1) == b""  # every connection to the door has ended
    assert replacement.recv(1) == b""
    for sock in (*waiting, replacement):
        sock.close()
    # Open again after the shut (after a checkpoint): a relay afresh, spares at the door.
    assert supervisor.ask("ports.open", door=path, spare=1).get("idle") == 1
    listener.accept()[0].close()


def test_it_says_hello_to_the_kernel_then_links_to_the_host_with_the_token(tmp_path):
    """The kernel waits for the supervisor's hello before it says it is ready (a pool's
    template is saved with its supervisor up); the host's link, asked for through the
    kernel, starts with the token it was asked with."""
    supervisor = Supervisor(tmp_path)
    try:
        await_supervisor(supervisor.kernel)
        supervisor.kernel.setblocking(False)
        with pytest.raises(BlockingIOError):  # the hello was all it said to the kernel
            supervisor.kernel.recv(1)
        supervisor.kernel.setblocking(True)
        assert supervisor.connect("s3cret") == {"op": "proc.hello", "token": "s3cret"}
        assert supervisor.ask("proc.list") == {"op": "proc.reply", "rid": 1, "processes": []}
    finally:
        supervisor.close()


def test_a_door_deeper_than_a_sockets_path_holds_is_reached_through_its_directory(tmp_path):
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    supervisor = Supervisor(deep)
    try:
        assert len(supervisor.door) > 108
        assert supervisor.connect("deep") == {"op": "proc.hello", "token": "deep"}
        assert supervisor.ask("proc.list")["processes"] == []
    finally:
        supervisor.close()


def test_rest_ends_the_link_and_what_comes_meanwhile_waits_for_the_next(supervisor, tmp_path):
    """Before a checkpoint the link ends (gVisor can't save a socket connected to the
    host); a command that prints and ends meanwhile is told on the next link, after its
    hello."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    started = supervisor.ask("proc.start", argv=["cat", str(fifo)], user=getpass.getuser())
    assert "pid" in started, started
    assert supervisor.ask("proc.rest") == {"op": "proc.reply", "rid": 2}
    assert supervisor.reader.read(1) == b""  # the supervisor ended the link
    supervisor.reader.close()
    supervisor.link.close()
    fifo.write_bytes(b"while unlinked\n")  # cat prints it and ends
    assert supervisor.connect("second") == {"op": "proc.hello", "token": "second"}
    output = supervisor.until(lambda f: f.get("op") == "proc.out")
    assert base64.b64decode(output["data"]) == b"while unlinked\n"
    assert supervisor.until(lambda f: f.get("op") == "proc.exit")["exit_code"] == 0
    assert supervisor.ask("proc.list")["processes"] == []


def test_a_door_that_cant_be_reached_is_said_and_the_relay_is_dropped(supervisor, tmp_path):
    refused = supervisor.ask("ports.open", door=str(tmp_path / "nobody.sock"), spare=2)
    assert "can't be reached" in refused["error"]
    assert "no door" in supervisor.ask("ports.open", spare=2)["error"]
    assert supervisor.ask("ports.shut").get("ended") == 0


def test_rest_lets_the_spare_leader_go_and_forks_none_until_a_command(supervisor):
    started = supervisor.ask("proc.start", argv=["true"], user=getpass.getuser())
    assert "pid" in started, started
    ended = supervisor.until(lambda f: f.get("op") == "proc.exit")
    assert ended["exit_code"] == 0
    deadline = time.monotonic() + DEADLINE_S
    while not supervisor.children():  # the next command's leader, forked once idle
        assert time.monotonic() < deadline, "no spare leader was forked"
        time.sleep(0.01)
    assert supervisor.ask("proc.rest") == {"op": "proc.reply", "rid": 2}
    assert supervisor.children() == []  # killed and reaped before the answer
    supervisor.reader.close()  # the link ended with the answer: the host asks for another
    supervisor.link.close()
    assert supervisor.connect("again")["token"] == "again"
    again = supervisor.ask("proc.start", argv=["true"], user=getpass.getuser())
    assert "pid" in again, again  # a command after the rest forks its own leader
    assert supervisor.until(lambda f: f.get("op") == "proc.exit")["exit_code"] == 0


def _read(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        piece = sock.recv(count - len(data))
        assert piece, "closed early"
        data += piece
    return data


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        piece = sock.recv(1)
        assert piece, "closed early"
        data += piece
    return data
