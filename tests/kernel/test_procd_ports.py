"""The process supervisor serves the ports' relay in its own loop, and lets its spare leader
go before a checkpoint: unit tests of `cloche.kernel.procd` run as a process of the host
(no sandbox: the loop and its frames; the sandboxed path is in tests/server/test_ports.py).

Each Python process a sandbox holds adds about its own size to the sandbox's checkpoint,
so the supervisor must not fork a relay, and must keep no spare leader into an image."""

from __future__ import annotations

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
from cloche.kernel.router import Router, await_supervisor

HEADER = struct.Struct(">I")
DEADLINE_S = 30.0


class Supervisor:
    """procd in a process of its own, spoken to as the kernel's router does."""

    def __init__(self) -> None:
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
        self.link = ours
        self.link.settimeout(DEADLINE_S)
        self.reader = ours.makefile("rb")
        self.rids = iter(range(1, 1 << 30))
        self.frames: list[dict[str, Any]] = []  # not yet looked at

    def ask(self, op: str, **fields: Any) -> dict[str, Any]:
        rid = next(self.rids)
        self.send({"op": op, "rid": rid, **fields})
        return self.until(lambda f: f.get("op") == "proc.reply" and f.get("rid") == rid)

    def send(self, message: dict[str, Any]) -> None:
        body = json.dumps(message).encode()
        self.link.sendall(HEADER.pack(len(body)) + body)

    def until(self, wanted: Any) -> dict[str, Any]:
        for frame in self.frames:
            if wanted(frame):
                self.frames.remove(frame)
                return frame
        while True:
            header = self.reader.read(HEADER.size)
            assert len(header) == HEADER.size, "the supervisor has gone"
            frame = json.loads(self.reader.read(HEADER.unpack(header)[0]))
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
        self.reader.close()
        self.link.close()  # the supervisor exits once its kernel has gone
        try:
            self.process.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    running = Supervisor()
    try:
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


def test_its_first_frame_says_it_serves_and_the_kernel_keeps_it_to_itself(supervisor):
    """The kernel waits for the supervisor's hello before it says it is ready (a pool's
    template is saved with its supervisor up); the hello never reaches the host."""
    await_supervisor(supervisor.link)
    assert supervisor.ask("proc.list") == {"op": "proc.reply", "rid": 1, "processes": []}
    assert supervisor.frames == []  # nothing came before the answer: the hello was taken
    late = socket.socketpair()  # a hello that came after the wait gave up is dropped
    forwarded: list[bytes] = []
    router = Router.__new__(Router)
    router._channel = type("Channel", (), {"send_frame": lambda _, f: forwarded.append(f)})()
    hello = json.dumps(HELLO, separators=(",", ":")).encode()
    other = b'{"op":"proc.exit"}'
    late[1].sendall(HEADER.pack(len(hello)) + hello + HEADER.pack(len(other)) + other)
    late[1].close()
    router._read_supervisor(late[0])  # closes its reader, not the socket
    late[0].close()
    assert forwarded == [HEADER.pack(len(other)) + other]


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
