"""The host's end of a sandbox's process supervisor (`cloche.sessions.supervisor_link`),
over real unix sockets: what counts as the supervisor, what waits for it, and how the
link ends. (The supervisor's side is in tests/kernel/test_procd_ports.py; both together,
in a sandbox, in tests/server/test_commands.py and the durability suites.)"""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from cloche.errors import InvalidMessage
from cloche.sessions.supervisor_link import GONE, MAX_RELINKS, SOCKET, SupervisorLink

HEADER = struct.Struct(">I")


def frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message).encode()
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    (length,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    message: dict[str, Any] = json.loads(await reader.readexactly(length))
    return message


async def until(done: Any) -> None:
    """Let the loop run until done() (the link's callbacks have run), for 30 s at most."""
    deadline = asyncio.get_running_loop().time() + 30
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "never happened"
        await asyncio.sleep(0.01)


class Host:
    """A link, what it asked the kernel for, what came from the supervisor, and why it went."""

    def __init__(self, door: Path) -> None:
        self.asked: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []
        self.gone: list[str] = []
        self.link = SupervisorLink("sb", 1 << 16, self.on_message, self.gone.append)
        self.door = door

    def on_message(self, message: dict[str, Any]) -> None:
        if message.get("op") != "proc.reply":
            raise InvalidMessage("not a reply")
        self.received.append(message)

    def open(self) -> None:
        self.link.open(self.door, "/inside", self.asked.append)

    async def connect(
        self, token: str | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the door that says hello (with the token asked, by default)."""
        reader, writer = await asyncio.open_unix_connection(str(self.door / SOCKET))
        token = self.asked[-1]["token"] if token is None else token
        writer.write(frame({"op": "proc.hello", "token": token}))
        await writer.drain()
        return reader, writer


async def test_only_a_connection_with_the_token_counts_and_gets_what_waited(tmp_path) -> None:
    host = Host(tmp_path)
    host.open()
    assert host.asked == [
        {"op": "proc.link", "path": f"/inside/{SOCKET}", "token": host.asked[0]["token"]}
    ]
    host.link.send({"op": "proc.list", "rid": 1})  # before the supervisor has connected
    impostor, impostor_writer = await host.connect("guessed")
    assert await impostor.read() == b""  # closed at once, told nothing
    impostor_writer.close()
    assert not host.link.linked and host.gone == []
    reader, writer = await host.connect()
    assert await read_frame(reader) == {"op": "proc.list", "rid": 1}  # what waited
    second, second_writer = await host.connect(host.asked[0]["token"])  # used once
    assert await second.read() == b""
    second_writer.close()
    writer.write(frame({"op": "proc.reply", "rid": 1, "processes": []}))
    await writer.drain()
    await until(lambda: host.received)
    assert host.received == [{"op": "proc.reply", "rid": 1, "processes": []}]
    assert host.gone == []
    host.link.close()
    assert await reader.read() == b""
    writer.close()
    assert not (tmp_path / SOCKET).exists()


async def test_an_end_after_a_rest_is_expected_and_any_other_asks_for_a_new_link(
    tmp_path,
) -> None:
    host = Host(tmp_path)
    host.open()
    reader, writer = await host.connect()
    await until(lambda: host.link.linked)

    async def rest() -> None:  # the supervisor answers its proc.rest, then ends the link
        writer.close()

    await host.link.rest(rest)
    assert not host.link.linked and host.gone == []
    host.link.send({"op": "proc.list", "rid": 2})  # waits for the next link
    host.link.relink()
    assert len(host.asked) == 2 and host.asked[1]["token"] != host.asked[0]["token"]
    reader, writer = await host.connect()
    assert await read_frame(reader) == {"op": "proc.list", "rid": 2}
    for relinked in range(MAX_RELINKS):  # an end nobody asked for: a new link is asked for
        writer.close()
        await until(lambda n=3 + relinked: len(host.asked) == n)  # type: ignore[misc]
        assert host.gone == [] and not host.link.linked
        reader, writer = await host.connect()
        await until(lambda: host.link.linked)
    writer.close()  # ... a few times; then the supervisor is taken for gone
    await until(lambda: host.gone)
    assert host.gone == [GONE] and len(host.asked) == 2 + MAX_RELINKS
    host.link.relink()  # asks nothing any more
    assert len(host.asked) == 2 + MAX_RELINKS
    host.link.close()


async def test_the_supervisor_gone_is_told_once(tmp_path) -> None:
    # Killed from inside: its link ended, the one asked for again never comes; the kernel
    # could not pass the request on (`proc.gone`), and says why.
    host = Host(tmp_path)
    host.open()
    host.link.send({"op": "proc.list", "rid": 1})
    host.link.gone("the sandbox's process supervisor has ended (killed from inside?)")
    assert host.gone == ["the sandbox's process supervisor has ended (killed from inside?)"]
    host.link.gone("again")  # told once
    assert len(host.gone) == 1
    host.link.close()


@pytest.mark.parametrize(
    "bad",
    [
        frame({"op": "proc.exit"}),  # refused by the host's checks (here: not a reply)
        HEADER.pack(1 << 20) + b"{",  # over the largest frame believed
        HEADER.pack(3) + b"{x}",  # not JSON
    ],
)
async def test_a_supervisor_that_breaks_the_protocol_is_taken_for_gone(tmp_path, bad) -> None:
    host = Host(tmp_path)
    host.open()
    reader, writer = await host.connect()
    await until(lambda: host.link.linked)
    writer.write(bad)
    await writer.drain()
    assert await reader.read() == b""  # the host ended it
    writer.close()
    assert len(host.gone) == 1 and "broke the protocol" in host.gone[0]
    host.link.close()


async def test_a_rest_waits_for_a_link_asked_for_before_the_checkpoint(tmp_path) -> None:
    # A session paused just after it started: its supervisor may connect in the middle of
    # the checkpoint, which would then fail; the rest waits for it, and ends it.
    host = Host(tmp_path)
    host.open()
    rested: list[bool] = []
    ends: list[asyncio.StreamWriter] = []

    async def rest() -> None:
        rested.append(True)
        ends[0].close()

    resting = asyncio.create_task(host.link.rest(rest))
    await asyncio.sleep(0)
    assert not resting.done()
    _, writer = await host.connect()
    ends.append(writer)
    await resting
    assert rested == [True] and not host.link.linked and host.gone == []
    host.link.close()
