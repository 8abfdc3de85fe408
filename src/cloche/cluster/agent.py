"""A node agent: one per machine of the cluster, holding that machine's sessions.

It is this node's `LocalSessionManager` (sandboxes, pools, paused sessions, snapshots),
served to front ends over the data path (`cluster/link.py`), with its sessions' events kept
for them to take (`cluster/relay.py`), and, through Ray, the verbs that move sessions
between nodes. It runs as a Ray actor pinned to its node
(`cluster/engine.py` makes it one); nothing here imports Ray, so it is tested without.

Fencing: a node whose heartbeats went unanswered (its process frozen, SIGSTOPped, cut off)
is declared dead by a front end, for good, and its sessions are told lost. If it comes back,
its agent learns so from the directory (`Membership`, asked every MEMBERSHIP_CHECK_S),
serves nothing more, closes every session it held and deletes their paused images and its
snapshots (reported lost: none may come back), says so, and ends its process. A front end
then starts a new agent on that machine, as it does for a new one: a new node id (and
certificate), nothing on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import itertools
import logging
import os
import signal
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

from cloche.cluster import codec
from cloche.cluster.directory import DEAD
from cloche.cluster.link import AgentServer
from cloche.cluster.relay import EventSink, Outbox, Told
from cloche.cluster.tls import AgentTLS
from cloche.config import ServerConfig
from cloche.errors import ClocheError, PathRefused, SessionLost
from cloche.llm.bridge import SessionsLLM
from cloche.llm.broker import Broker
from cloche.sandbox.registry import create_backend
from cloche.sessions.kernel import EventCallback
from cloche.sessions.local import LocalSessionManager
from cloche.sessions.observer import Observer
from cloche.sessions.store import RecordState, SessionRecord, SnapshotRecord

if TYPE_CHECKING:
    from cloche.egress.service import Egress

log = logging.getLogger("cloche.cluster")
MAX_OPEN_READS = 64  # files being read through the data path at once, per node

MEMBERSHIP_CHECK_S = 1.0  # how often an agent asks the directory whether it was declared dead
MEMBERSHIP_WAIT_S = 10.0  # an answer slower than this (Ray busy, a partition): asked again


def memory_available_bytes() -> int:
    """MemAvailable of this machine (0 when it can't be read)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _node_egress(
    config: ServerConfig, figures: NodeFigures | None, ca: tuple[bytes, bytes] | None
) -> Egress | None:
    """This node's egress (with --egress-policy): its own doors and audit file, the policy
    and secrets files read at the same paths on every node (a mounted Secret on Kubernetes)."""
    if config.egress_policy is None:
        return None
    from cloche.egress.service import Egress

    audit = config.egress_audit or config.data_dir / "egress" / "audit.jsonl"
    report = getattr(figures, "egress_record", None)
    return Egress.load(config.egress_policy, audit, report, config.egress_secrets, ca)


def _watch_sigterm(agent: NodeAgent) -> None:
    """Mark the agent leaving the moment its process gets SIGTERM. Its sandboxes die within
    ~0.1 s of it, while the agent still answers for a second or two; without the mark their
    cells were answered "killed by SIGKILL ... memory", then "not found".

    An actor is made, and runs, off the worker's main thread, where no signal handler may
    be set (Ray's own, there, raises SystemExit). faulthandler may register from any
    thread, at the C level, chained to the handler before it: on SIGTERM it writes a
    traceback to a pipe, and the pipe's first byte tells the agent's loop."""
    out, into = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    faulthandler.register(signal.SIGTERM, file=into, all_threads=False, chain=True)

    def leaving() -> None:
        if agent.leaving is None:
            agent.leaving = "its node is shutting down (SIGTERM)"
            log.warning("node agent %s: SIGTERM; its sessions are lost", agent.node_id)
        with contextlib.suppress(OSError):
            os.read(out, 65536)

    asyncio.get_running_loop().add_reader(out, leaving)


class NodeFigures(Protocol):
    """What an agent reports to, when it is given one: an observer of its manager (the
    server's Prometheus metrics, made with where its events go on to) that also reads the
    manager's state and renders it all."""

    def watch(self, manager: LocalSessionManager) -> None: ...

    def render(self) -> bytes: ...

    def events_dropped(self, count: int) -> None: ...


class Membership(Protocol):
    """The cluster's word on this node, from its directory (over Ray: `cluster/engine.py`)."""

    async def state(self, node_id: str) -> str | None:
        """The node's state there (alive, draining, dead; None before it joined)."""
        ...

    async def fenced(self, node_id: str) -> None:
        """Tell it the dead node holds nothing any more: its machine may have a new agent."""
        ...

    def exit(self) -> None:
        """End this agent's process (a new agent takes its place)."""
        ...


class NodeAgent:
    """This node's sessions, served to front ends."""

    def __init__(
        self,
        config: ServerConfig,
        node_id: str,
        secret: str,
        host: str,
        figures: Callable[[EventSink], NodeFigures] | None = None,
        egress_ca: tuple[bytes, bytes] | None = None,
        watch_sigterm: bool = False,
        tls: AgentTLS | None = None,
        membership: Membership | None = None,
    ) -> None:
        """membership: where the agent learns that it was declared dead (none: it never
        fences itself, as in tests of the data path)."""
        self.config = config
        self.node_id = node_id
        self.host = host
        # Its sessions' events, kept for the front ends to take (`events_since`).
        self.outbox = Outbox(config.events_buffer, self._events_dropped)
        # This node's figures (the server's Prometheus metrics, given by the front end that
        # made the agent), for the front ends' /metrics; none without.
        self.figures = figures(self._tell) if figures is not None else None
        observer = self.figures if isinstance(self.figures, Observer) else Told(self._tell)
        self.egress = _node_egress(config, self.figures, egress_ca)  # this node's doors
        self.broker: Broker | None = None  # llm_query for this node's cells
        llm = None
        if config.llm is not None:
            self.broker = Broker(config.llm, observer)
            llm = SessionsLLM(self.broker, config.max_frame_bytes)
        self.manager = LocalSessionManager(
            config, create_backend(config), observer=observer, egress=self.egress, llm=llm
        )
        if self.figures is not None:
            self.figures.watch(self.manager)
        # The data path's mutual TLS (None only where a test serves it on loopback in clear).
        context = tls.server_context() if tls is not None else None
        self.server = AgentServer(node_id, secret, self._handle, self._greeting, tls=context)
        self.port = 0
        self._started: asyncio.Task[None] | None = None
        self._streams: dict[int, Any] = {}  # open streamed files, by handle
        self._reads: dict[int, AsyncGenerator[bytes, None]] = {}  # files being read, by handle
        self._stream_numbers = itertools.count(1)
        self._seq = itertools.count(1)
        # Why this node is going away (its process got SIGTERM), once it is: its sandboxes
        # die with it, and what they answer then ("killed", "not found") is not the story.
        self.leaving: str | None = None
        self._watch_sigterm = watch_sigterm  # in a process of its own (a Ray actor's)
        self._membership = membership
        self._watching: asyncio.Task[None] | None = None
        # Why the cluster declared this node dead, once the agent learnt it (it fences).
        self.fenced: str | None = None

    async def start(self) -> dict[str, Any]:
        """Start the manager and the data path once; where front ends reach it."""
        if self._started is None:
            self._started = asyncio.create_task(self._start())
        await asyncio.shield(self._started)
        return self.describe()

    async def _start(self) -> None:
        if self._watch_sigterm:
            _watch_sigterm(self)
        await self.manager.start()
        self.port = await self.server.start(self.host, self.config.cluster_agent_port)
        log.info("node agent %s serving on %s:%d", self.node_id, self.host, self.port)
        if self._membership is not None:
            self._watching = asyncio.create_task(self._watch_membership(self._membership))

    async def _watch_membership(self, membership: Membership) -> None:
        """Ask the directory, every MEMBERSHIP_CHECK_S, whether this node was declared dead
        (after a freeze, the first ask is at once); fence it when it was."""
        while True:
            await asyncio.sleep(MEMBERSHIP_CHECK_S)
            try:
                state = await asyncio.wait_for(membership.state(self.node_id), MEMBERSHIP_WAIT_S)
            except Exception as exc:  # the directory out of reach: the verdict can wait
                log.warning("node agent %s: the directory did not answer: %s", self.node_id, exc)
                continue
            if state == DEAD:
                await self.fence("its node failed")  # as the front ends say it
                return

    async def fence(self, why: str) -> None:
        """Stop being this node, which the cluster declared dead and whose sessions it told
        lost: serve nothing more, close every session and delete every paused image and
        snapshot held here, tell the directory, and end this process."""
        if self.fenced is not None:
            return
        self.fenced = why
        log.warning("node agent %s was declared dead (%s): fencing it", self.node_id, why)
        await self.server.close()  # any front end still linked to it learns it is gone
        try:
            closed = await self.manager.abandon("node_lost")
        except Exception:  # what stays might come back: no new agent here, an operator's call
            log.exception("node agent %s: fencing failed; it stays, serving nothing", self.node_id)
            return
        if self.egress is not None:
            self.egress.close()
        if self.broker is not None:
            await self.broker.close()
        log.warning("node agent %s fenced: %d sessions closed, nothing kept", self.node_id, closed)
        if self._membership is not None:
            try:
                await asyncio.wait_for(self._membership.fenced(self.node_id), MEMBERSHIP_WAIT_S)
            except Exception as exc:  # its machine gets no new agent until a front end sees
                log.error("node agent %s: the directory was not told: %s", self.node_id, exc)
            self._membership.exit()

    def _tell(
        self, kind: str, session_id: str | None, owner_key: str | None, data: dict[str, Any]
    ) -> None:
        """An event of this node's sessions, kept for the front ends (it never waits)."""
        gone = self.leaving or self.fenced
        if gone is not None and kind == "session.closed":
            # Its sandbox died because the node is going: lost with its node, as its
            # requests answer.
            data = {**data, "end_reason": "node_lost", "why": gone}
        self.outbox.add(kind, session_id, owner_key, data)

    def _events_dropped(self, count: int) -> None:
        if self.figures is not None:
            self.figures.events_dropped(count)

    def _greeting(self) -> dict[str, Any]:
        """What a front end is told as it connects: where its events start (after those
        some front end has taken)."""
        return {"events": self.outbox.taken}

    def describe(self) -> dict[str, Any]:
        return {"id": self.node_id, "host": self.host, "port": self.port, "pid": os.getpid()}

    async def stop(self) -> None:
        """Close the data path, then every session (paused to --data-dir, as a server does)."""
        if self.fenced is not None:
            return  # it holds nothing, and its process ends
        if self._watching is not None:
            self._watching.cancel()
        await self.server.close()
        await self.manager.stop()
        if self.egress is not None:
            self.egress.close()
        if self.broker is not None:
            await self.broker.close()

    def stats(self) -> dict[str, Any]:
        """What placement and GET /v1/cluster need; `seq` orders answers from this agent."""
        manager = self.manager
        return {
            "seq": next(self._seq),
            "sessions": manager.live_count,
            "paused": manager.paused_count,
            "max_sessions": self.config.max_sessions,
            "pool": {name: pool.ready_count for name, pool in manager.pools.items()},
            "memory_available_bytes": memory_available_bytes(),
            "healthy": manager.healthy,
            "ended_seq": manager.ended_seq,  # sessions that expired here, counted
            "events_dropped": self.outbox.dropped,  # before a front end took them
            "pid": os.getpid(),
        }

    # -- moving sessions (called through Ray; images go through its object store) ------

    async def export_session(self, session_id: str) -> tuple[dict[str, Any], bytes]:
        record, image = await self.manager.export_session(session_id)
        raw = asdict(record)
        raw["state"] = record.state.value
        return raw, image

    async def adopt_session(self, raw: dict[str, Any], image: bytes) -> None:
        if self.fenced is not None:
            raise ClocheError(f"node {self.node_id} was declared dead: it takes nothing in")
        record = SessionRecord(**{**raw, "state": RecordState(raw["state"])})
        await self.manager.adopt_session(record, bytes(image))

    async def release_session(self, session_id: str, moved: bool) -> None:
        await self.manager.release_session(session_id, moved=moved)

    async def export_snapshot(self, snapshot_id: str) -> tuple[dict[str, Any], bytes]:
        record, image = await self.manager.export_snapshot(snapshot_id)
        return asdict(record), image

    async def adopt_snapshot(self, raw: dict[str, Any], image: bytes) -> None:
        if self.fenced is not None:
            raise ClocheError(f"node {self.node_id} was declared dead: it takes nothing in")
        await self.manager.adopt_snapshot(SnapshotRecord(**raw), bytes(image))

    def held(self) -> tuple[list[str], list[str]]:
        """The ids of every session (paused ones too) and snapshot here: what a drain moves."""
        return self.manager.session_ids(), self.manager.snapshot_ids()

    # -- the data path --------------------------------------------------------------------

    async def _handle(self, op: str, args: dict[str, Any], on_event: EventCallback) -> Any:
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            raise ClocheError(f"unknown data-path request {op!r}")
        session_id = args.get("session_id")
        self._check_leaving(session_id)
        try:
            answer = await handler(on_event=on_event, **args)
        except ClocheError:
            self._check_leaving(session_id)  # a session that died with its node: lost
            raise
        self._check_leaving(session_id)  # a cell killed as its node went: lost, not killed
        return answer

    def _check_leaving(self, session_id: object) -> None:
        gone = self.leaving or self.fenced
        if gone is not None and isinstance(session_id, str):
            lost = SessionLost(session_id)
            lost.args = (f"Session {session_id} was lost: {gone}",)
            raise lost
        if self.fenced is not None:
            raise ClocheError(f"node {self.node_id} was declared dead: it serves nothing")

    async def _op_stats(self, on_event: EventCallback) -> dict[str, Any]:
        return self.stats()

    async def _op_create(
        self,
        on_event: EventCallback,
        owner: str | None,
        profile: str,
        snapshot: str | None,
        egress: str | dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
        cell_timeout_s: float | None = None,
        template: str | None = None,
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        info = await self.manager.create(
            owner,
            profile,
            snapshot,
            egress,
            metadata,
            cell_timeout_s=cell_timeout_s,
            template=template,
            env=env,
        )
        return {"info": codec.info_out(info), "stats": self.stats()}

    async def _op_ended_since(self, on_event: EventCallback, seq: int) -> dict[str, Any]:
        """Sessions that expired here since seq (idle timeout, lifetime): for the directory."""
        return {"seq": self.manager.ended_seq, "ids": self.manager.ended_since(seq)}

    async def _op_events_since(
        self, on_event: EventCallback, seq: int, limit: int, wait_s: float
    ) -> dict[str, Any]:
        """This node's events after number seq, for a front end's bus (a long poll)."""
        return await self.outbox.since(seq, limit, wait_s)

    async def _op_holds(self, on_event: EventCallback, session_id: str) -> bool:
        """Whether this node holds the session, whoever owns it (a front end looking for it)."""
        return session_id in self.manager.session_ids()

    async def _op_info(self, on_event: EventCallback, session_id: str, owner: str | None) -> Any:
        return codec.info_out(await self.manager.info(session_id, owner))

    async def _op_sessions(
        self,
        on_event: EventCallback,
        owner: str | None,
        every: bool = False,
        state: str | None = None,
        profile: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Any:
        found = await self.manager.sessions(
            owner, every=every, state=state, profile=profile, metadata=metadata
        )
        return [codec.info_out(info) for info in found]

    async def _op_set_metadata(
        self,
        on_event: EventCallback,
        session_id: str,
        changes: dict[str, str | None],
        owner: str | None,
    ) -> Any:
        return codec.info_out(await self.manager.set_metadata(session_id, changes, owner))

    async def _op_history(
        self,
        on_event: EventCallback,
        session_id: str,
        owner: str | None,
        after: int,
        limit: int | None,
    ) -> Any:
        found = await self.manager.history(session_id, owner, after=after, limit=limit)
        return [entry.to_json() for entry in found]

    async def _op_cell(
        self, on_event: EventCallback, session_id: str, number: int, owner: str | None
    ) -> Any:
        return (await self.manager.cell(session_id, number, owner)).to_json()

    async def _op_execute(
        self,
        on_event: EventCallback,
        session_id: str,
        code: str,
        owner: str | None,
        timeout_s: float | None,
        track_files: bool,
        silent: bool,
        stream: bool,
        stdin: bool = False,
        pager: bool = False,
        front_end: str = "",
        accepted: bool = False,
    ) -> Any:
        # With accepted, the front end waits for the cell to be queued (or refused as busy)
        # before it answers: told as an event of its own as soon as the session queues it.
        queued = _TellsWhenSet(on_event) if accepted else None
        result = await self.manager.execute(
            session_id,
            code,
            owner=owner,
            timeout_s=timeout_s,
            on_event=on_event if stream else None,
            track_files=track_files,
            silent=silent,
            stdin=stdin,
            pager=pager,
            front_end=front_end,
            accepted=queued,
        )
        return codec.result_out(result)

    async def _op_interrupt(
        self, on_event: EventCallback, session_id: str, owner: str | None
    ) -> Any:
        return await self.manager.interrupt(session_id, owner)

    async def _op_restart(self, on_event: EventCallback, session_id: str, owner: str | None) -> Any:
        return codec.info_out(await self.manager.restart(session_id, owner))

    async def _op_answer_input(
        self, on_event: EventCallback, session_id: str, owner: str | None, value: str
    ) -> Any:
        return await self.manager.answer_input(session_id, value, owner)

    async def _op_close(
        self, on_event: EventCallback, session_id: str, owner: str | None, reason: str
    ) -> None:
        await self.manager.close(session_id, owner, reason)

    async def _op_snapshot(
        self, on_event: EventCallback, session_id: str, owner: str | None, name: str
    ) -> Any:
        return codec.snapshot_out(await self.manager.snapshot(session_id, owner, name))

    async def _op_snapshots(self, on_event: EventCallback, owner: str | None) -> Any:
        return [codec.snapshot_out(r) for r in await self.manager.snapshots(owner)]

    async def _op_get_snapshot(
        self, on_event: EventCallback, snapshot_id: str, owner: str | None
    ) -> Any:
        return codec.snapshot_out(await self.manager.get_snapshot(snapshot_id, owner))

    async def _op_delete_snapshot(
        self, on_event: EventCallback, snapshot_id: str, owner: str | None
    ) -> None:
        await self.manager.delete_snapshot(snapshot_id, owner)

    async def _op_fork(
        self, on_event: EventCallback, session_id: str, count: int, owner: str | None
    ) -> Any:
        copies = await self.manager.fork(session_id, count, owner)
        return {"copies": [codec.info_out(i) for i in copies], "stats": self.stats()}

    async def _op_pause(self, on_event: EventCallback, session_id: str, owner: str | None) -> Any:
        return codec.info_out(await self.manager.pause(session_id, owner))

    async def _op_resume(self, on_event: EventCallback, session_id: str, owner: str | None) -> Any:
        return codec.info_out(await self.manager.resume(session_id, owner))

    async def _op_list_files(
        self, on_event: EventCallback, session_id: str, owner: str | None
    ) -> Any:
        return codec.listing_out(await self.manager.list_files(session_id, owner))

    async def _op_read_file(
        self, on_event: EventCallback, session_id: str, path: str, owner: str | None
    ) -> Any:
        return codec.bytes_out(await self.manager.read_file(session_id, path, owner))

    async def _op_write_files(
        self, on_event: EventCallback, session_id: str, files: list[list[str]], owner: str | None
    ) -> None:
        decoded = [(path, codec.bytes_in(data)) for path, data in files]
        await self.manager.write_files(session_id, decoded, owner)

    async def _op_stream_open(
        self, on_event: EventCallback, session_id: str, path: str, owner: str | None
    ) -> int:
        """A streamed file, written from the chunks that `stream_chunk` brings."""
        await self.manager.info(session_id, owner)
        handle = next(self._stream_numbers)
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)

        async def pieces() -> AsyncIterator[bytes]:
            while (chunk := await chunks.get()) is not None:
                yield chunk

        writing = asyncio.create_task(self.manager.write_stream(session_id, path, pieces(), owner))
        self._streams[handle] = (chunks, writing)
        return handle

    async def _op_stream_chunk(self, on_event: EventCallback, handle: int, data: str) -> None:
        chunks, writing = self._stream(handle)
        put = asyncio.ensure_future(chunks.put(codec.bytes_in(data)))
        await asyncio.wait([put, writing], return_when=asyncio.FIRST_COMPLETED)
        if not put.done():  # the writer stopped (refused): say why, and forget it
            put.cancel()
            self._streams.pop(handle, None)
            await writing

    async def _op_stream_end(self, on_event: EventCallback, handle: int, commit: bool) -> int:
        chunks, writing = self._stream(handle)
        del self._streams[handle]
        if commit:
            await chunks.put(None)
            size: int = await writing
            return size
        writing.cancel()
        await asyncio.gather(writing, return_exceptions=True)
        return 0

    def _stream(self, handle: int) -> tuple[asyncio.Queue[bytes | None], asyncio.Task[int]]:
        if handle not in self._streams:
            raise PathRefused("", f"no streamed file {handle}")
        found: tuple[asyncio.Queue[bytes | None], asyncio.Task[int]] = self._streams[handle]
        return found

    async def _op_read_open(
        self, on_event: EventCallback, session_id: str, path: str, owner: str | None
    ) -> dict[str, int]:
        """A file to be read in pieces (`read_piece`, until one is empty); its size."""
        if len(self._reads) >= MAX_OPEN_READS:  # forgotten by front ends that went away
            oldest = next(iter(self._reads))
            await self._reads.pop(oldest).aclose()
        size, pieces = await self.manager.read_stream(session_id, path, owner)
        handle = next(self._stream_numbers)
        self._reads[handle] = pieces
        return {"handle": handle, "size": size}

    async def _op_read_piece(self, on_event: EventCallback, handle: int) -> str:
        """The next piece of an opened file, base64; "" at its end (then it is closed)."""
        pieces = self._reads.get(handle)
        if pieces is None:
            raise PathRefused("", f"no file opened for reading as {handle}")
        try:
            return codec.bytes_out(await anext(pieces))
        except StopAsyncIteration:
            del self._reads[handle]
            return ""

    async def _op_read_close(self, on_event: EventCallback, handle: int) -> None:
        pieces = self._reads.pop(handle, None)
        if pieces is not None:
            await pieces.aclose()

    async def _op_install_packages(
        self, on_event: EventCallback, session_id: str, specs: list[str], owner: str | None
    ) -> Any:
        return await self.manager.install_packages(session_id, specs, owner)

    async def _op_metrics(self, on_event: EventCallback) -> str:
        return self.figures.render().decode() if self.figures is not None else ""

    async def _op_profiles(self, on_event: EventCallback) -> Any:
        return self.manager.profiles()


class _TellsWhenSet(asyncio.Event):
    """An event that, once set, sends the front end a `codec.ACCEPTED` event."""

    def __init__(self, on_event: EventCallback) -> None:
        super().__init__()
        self._on_event = on_event

    def set(self) -> None:
        if not self.is_set():
            self._on_event({"type": codec.ACCEPTED})
        super().set()
