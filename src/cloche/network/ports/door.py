"""One session's ports door on the host: the connections its sandbox's relay opens to it,
taken one per connection to a server inside (the relay's protocol: `cloche.kernel.ports`).

The door listens in the sandbox's door directory (`ports.sock`) only once a port is asked
for: the relay is told to connect (`ports.open`, over the kernel's channel), and keeps a few
connections waiting. Taking one, the host writes `C <port>` and what it has to send; the
relay answers `K` (connected: the rest is the server's) or `E <errno> <why>`. Connections a
server keeps alive wait here for the next request to the same port.

Everything the relay sends is untrusted (it runs as the session's user): lines are bounded,
answers are waited for with deadlines, and the door stops accepting while enough wait.
Before a checkpoint the door is shut (`shut`): every connection ends, on both sides, and
none opens until the checkpoint is over (gVisor can't save a socket connected to the host).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from cloche.errors import PortUnreachable
from cloche.network.door_socket import listen_at

log = logging.getLogger("cloche.ports")

SOCKET = "ports.sock"  # in a sandbox's door directory
SPARE = 4  # connections the relay keeps waiting at the door
MAX_WAITING = 16  # more than this waiting, and the door stops taking them (a hostile relay)
KEPT_PER_PORT = 16  # connections kept alive by a server, waiting for the next request
KEPT_FOR_S = 20.0  # a kept connection older than this is not used again
READ_LIMIT_BYTES = 1 << 20  # a relay's answer line (the list of ports) at most
TAKE_TIMEOUT_S = 15.0  # for a waiting connection; past this the relay is stuck or gone
ANSWER_TIMEOUT_S = 10.0  # for the relay's K or E once it has the line

Ask = Callable[..., Awaitable[dict[str, Any]]]  # a request to the kernel: (op, **fields)


class Link:
    """One connection to a server inside the sandbox, through the door."""

    def __init__(
        self, door: PortDoor, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.door = door
        self.port = port
        self.reader = reader
        self.writer = writer
        self.reused = False  # it carried a request before
        self.kept_at = 0.0

    @property
    def stale(self) -> bool:
        """Closed meanwhile, or holding bytes nobody asked for: not to be used again."""
        return (
            self.writer.is_closing()
            or self.reader.at_eof()
            or bool(getattr(self.reader, "_buffer", b""))  # a server that said more than asked
            or time.monotonic() - self.kept_at > KEPT_FOR_S
        )

    def keep(self) -> None:
        """The exchange is over and the server keeps the connection: reuse it."""
        self.door.keep(self)

    def close(self) -> None:
        self.door.forget(self)
        self.writer.close()


class PortDoor:
    """The ports door of one session's sandbox.

    Args:
        session_id: whose door (in logs).
        directory: the host directory of the sandbox's doors.
        inside: that directory as the sandbox sees it.
        ask: sends a request to the sandbox's kernel (`ports.open`, `ports.shut`), its answer.
    """

    def __init__(self, session_id: str, directory: Path, inside: str, ask: Ask) -> None:
        self.session_id = session_id
        self.path = directory / SOCKET
        self.inside = f"{inside}/{SOCKET}"
        self._ask = ask
        self._listener: socket.socket | None = None
        self._accepting = False
        self._opening = asyncio.Lock()
        self._waiting: collections.deque[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            collections.deque()
        )
        self._takers: collections.deque[
            asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
        ] = collections.deque()
        self._kept: dict[int, collections.deque[Link]] = {}
        self._links: set[Link] = set()  # in use, or kept
        self._adopting: set[asyncio.Task[None]] = set()
        self._shut = asyncio.Event()  # cleared while a checkpoint is under way
        self._shut.set()
        self._asked = False  # the relay was told to open: it is told to shut before a checkpoint
        self.closed = False

    # -- what the front end asks -----------------------------------------------------------

    async def connect(self, port: int, first: bytes = b"") -> Link:
        """A connection to port on the sandbox's loopback, with first sent at once (a
        request's head): a kept-alive one if the server left one, else a new one.

        Raises:
            PortUnreachable: nothing listens on port, or the sandbox's relay does not answer.
        """
        kept = self._kept.get(port)
        while kept:
            link = kept.pop()
            if link.stale:
                link.close()
                continue
            link.reused = True
            if first:
                link.writer.write(first)
            return link
        reader, writer = await self._take()
        writer.write(b"C %d\n" % port + first)
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                line = await reader.readline()
        except (TimeoutError, ValueError, ConnectionError) as exc:
            writer.close()
            raise PortUnreachable(
                f"session {self.session_id}: its port relay did not answer for port {port}"
            ) from exc
        if line != b"K\n":
            writer.close()
            why = line.decode("utf-8", "replace").strip().partition(" ")[2].partition(" ")[2]
            if not line.startswith(b"E "):
                why = "its port relay closed the connection"
            raise PortUnreachable(
                f"nothing answers on port {port} in session {self.session_id} "
                f"({why[:200] or 'refused'})"
            )
        link = Link(self, port, reader, writer)
        self._links.add(link)
        return link

    async def listening(self) -> list[int]:
        """The TCP ports listened on in the sandbox.

        Raises:
            PortUnreachable: the sandbox's relay does not answer.
        """
        reader, writer = await self._take()
        try:
            writer.write(b"L\n")
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                line = await reader.readline()
            ports = json.loads(line)["ports"]
            if not isinstance(ports, list) or not all(
                type(p) is int and 0 < p < 65536 for p in ports
            ):
                raise ValueError("not a list of ports")
            return sorted(set(ports))
        except (TimeoutError, ValueError, KeyError, TypeError, ConnectionError) as exc:
            raise PortUnreachable(
                f"session {self.session_id}: its port relay did not list its ports ({exc})"
            ) from exc
        finally:
            writer.close()

    def keep(self, link: Link) -> None:
        kept = self._kept.setdefault(link.port, collections.deque())
        if len(kept) >= KEPT_PER_PORT or self.closed or not self._shut.is_set():
            link.close()
            return
        link.kept_at = time.monotonic()
        kept.append(link)

    def forget(self, link: Link) -> None:
        self._links.discard(link)
        kept = self._kept.get(link.port)
        if kept is not None and link in kept:
            kept.remove(link)

    # -- the connections the relay makes ---------------------------------------------------

    async def _take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection waiting at the door (the door opened first if it is not).

        Raises:
            PortUnreachable: none came in time.
        """
        if not self._shut.is_set():  # a checkpoint is under way: the door opens after it
            async with asyncio.timeout(TAKE_TIMEOUT_S):
                await self._shut.wait()
        if self.closed:
            raise PortUnreachable(f"session {self.session_id} has no sandbox running")
        await self._open()
        while self._waiting:
            reader, writer = self._waiting.popleft()
            self._resume_accepting()
            if _fresh(reader, writer):
                return reader, writer
            writer.close()
        taker = asyncio.get_running_loop().create_future()
        self._takers.append(taker)
        try:
            async with asyncio.timeout(TAKE_TIMEOUT_S):
                taken: tuple[asyncio.StreamReader, asyncio.StreamWriter] = await taker
                return taken
        except TimeoutError:
            raise PortUnreachable(
                f"session {self.session_id}: its port relay did not connect in {TAKE_TIMEOUT_S:g} s"
            ) from None
        finally:
            with contextlib.suppress(ValueError):
                self._takers.remove(taker)

    async def _open(self) -> None:
        """Listen, and have the relay connect (once)."""
        if self._listener is not None:
            return
        async with self._opening:
            if self._listener is not None:
                return
            self._listener = listen_at(self.path, MAX_WAITING)
            self._resume_accepting()
            self._asked = True
            try:
                reply = await self._ask("ports.open", door=self.inside, spare=SPARE)
            except Exception as exc:
                self._close_listener()
                raise PortUnreachable(
                    f"session {self.session_id}: its port relay could not be started ({exc})"
                ) from exc
            if isinstance(reply.get("error"), str):
                self._close_listener()
                raise PortUnreachable(
                    f"session {self.session_id}: its port relay did not connect: {reply['error']}"
                )

    def _resume_accepting(self) -> None:
        if self._listener is not None and not self._accepting:
            if len(self._waiting) + len(self._adopting) < MAX_WAITING:
                asyncio.get_running_loop().add_reader(self._listener, self._accept)
                self._accepting = True

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while len(self._waiting) + len(self._adopting) < MAX_WAITING:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            task = asyncio.ensure_future(self._adopt(sock))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)
        asyncio.get_running_loop().remove_reader(listener)  # enough wait: none more for now
        self._accepting = False

    async def _adopt(self, sock: socket.socket) -> None:
        _widen(sock)
        reader, writer = await asyncio.open_connection(sock=sock, limit=READ_LIMIT_BYTES)
        while self._takers:
            taker = self._takers.popleft()
            if not taker.done():
                taker.set_result((reader, writer))
                return
        self._waiting.append((reader, writer))  # checked again when taken (`_fresh`)

    # -- checkpoints and the end -----------------------------------------------------------

    def _close_listener(self) -> None:
        if self._listener is not None:
            if self._accepting:
                asyncio.get_running_loop().remove_reader(self._listener)
                self._accepting = False
            self._listener.close()
            self._listener = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _end_connections(self) -> None:
        """Close the listener and every connection."""
        self._close_listener()
        for task in list(self._adopting):
            task.cancel()
        await asyncio.gather(*self._adopting, return_exceptions=True)
        while self._waiting:
            self._waiting.popleft()[1].close()
        for link in list(self._links):
            link.close()
        self._kept.clear()
        while self._takers:
            taker = self._takers.popleft()
            if not taker.done():
                taker.set_exception(
                    PortUnreachable(f"session {self.session_id}: its ports door was closed")
                )

    async def shut(self) -> None:
        """End every connection, on both sides, before a checkpoint; the door opens again
        (when a port is next asked for) after `reopen`.

        Raises:
            PortUnreachable: the relay did not say it had ended its connections.
        """
        self._shut.clear()
        await self._end_connections()
        if not self._asked:
            return
        reply = await self._ask("ports.shut")
        self._asked = False
        if isinstance(reply.get("error"), str):
            raise PortUnreachable(f"the port relay did not end its connections: {reply['error']}")

    def reopen(self) -> None:
        """The checkpoint is over and the sandbox runs on: ports may be reached again."""
        self._shut.set()

    async def close(self) -> None:
        """The sandbox is gone (or going): end everything, for good."""
        self.closed = True
        await self._end_connections()
        self._shut.set()  # those waiting for a checkpoint's end learn it is closed


def _fresh(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Whether a waiting connection is as the relay leaves one: open, and silent until asked
    (one that said something, or ended, came from elsewhere in the sandbox, or is gone)."""
    said = getattr(reader, "_buffer", b"") or getattr(reader, "_eof", False)
    return not (writer.is_closing() or reader.at_eof() or said)


def _widen(sock: socket.socket) -> None:
    """Large kernel buffers for a door connection: with the default (~200 KiB), gVisor's
    reads of the door each waited for a refill (egress measured ~400 MiB/s, not ~3,700)."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, 4 * 1024 * 1024)
