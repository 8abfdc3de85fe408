"""envd's `process.Process` service over the session's commands and terminals.

As envd runs them: a started process runs on when its stream is dropped, until it ends or
its `Connect-Timeout-Ms` passes (then its group is killed); it runs as the user of the
request's `Authorization: Basic <user:>` (`user` by default); SIGKILL ends its whole tree.
Streams send a keepalive every `Keepalive-Ping-Interval` seconds while quiet.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.process import process_connect
from e2b.envd.process import process_pb as pb
from protobuf import Oneof

from cloche.errors import ClocheError
from cloche.server.e2b.routing import Reach, call
from cloche.sessions.commands import CommandSpec
from cloche.sessions.processes import Event, Exit, Output

FRONT_END = "e2b"
MAX_KEEPALIVE_S = 300.0


def one(field: str, value: Any) -> Any:
    """A oneof's value (its field's name is checked by the message, not by mypy)."""
    return Oneof(field, value)


def _end(exit: Exit) -> pb.ProcessEvent.EndEvent:
    if exit.exit_code is not None:
        status = f"exit status {exit.exit_code}"
        return pb.ProcessEvent.EndEvent(
            exit_code=exit.exit_code,
            exited=True,
            status=status,
            error=status if exit.exit_code else None,
        )
    if exit.signal is not None:
        try:
            name = (signal.strsignal(exit.signal) or str(exit.signal)).lower()
        except ValueError:
            name = str(exit.signal)
        status = f"signal: {name}"
        return pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=status, error=status)
    why = "the sandbox was lost" if not exit.suspended else "the sandbox was paused"
    return pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status="killed", error=why)


def _event(event: Event, pty: bool) -> pb.ProcessEvent:
    if isinstance(event, Exit):
        return pb.ProcessEvent(event=one("end", _end(event)))
    field = "pty" if pty else ("stdout" if event.fd == 1 else "stderr")
    return pb.ProcessEvent(
        event=one("data", pb.ProcessEvent.DataEvent(output=one(field, event.data)))
    )


def _keepalive_s(ctx: RequestContext[Any, Any]) -> float | None:
    raw = ctx.request_headers.get("keepalive-ping-interval")
    try:
        return min(max(float(raw), 1.0), MAX_KEEPALIVE_S) if raw else None
    except ValueError:
        return None


async def _with_keepalive(
    events: AsyncIterator[Event], every_s: float | None
) -> AsyncIterator[Event | None]:
    """events, with None for each quiet every_s; the process's end ends it."""
    queue: asyncio.Queue[Event | None] = asyncio.Queue(maxsize=16)

    async def pump() -> None:
        try:
            async for event in events:
                await queue.put(event)
        finally:
            await queue.put(None)

    task = asyncio.ensure_future(pump())
    try:
        while True:
            try:
                async with asyncio.timeout(every_s):
                    event = await queue.get()
            except TimeoutError:
                yield None
                continue
            if event is None:
                return
            yield event
            if isinstance(event, Exit):
                return
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ClocheError):
            await task
        closer: Callable[[], Any] | None = getattr(events, "aclose", None)
        if closer is not None:
            with contextlib.suppress(ClocheError, RuntimeError):
                await closer()


class ProcessService(process_connect.Process):
    """The service, over `Reach` (the request's sandbox, as its owner)."""

    def __init__(self, reach: Reach) -> None:
        self.reach = reach

    async def _pid(self, ctx: RequestContext[Any, Any], selector: pb.ProcessSelector | None) -> int:
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=pid):
                return int(pid)
            case Oneof(field="tag", value=tag):
                where = self.reach(ctx)
                for described in await where.manager.commands(where.id, where.owner):
                    if described.get("tag") == tag and type(described.get("pid")) is int:
                        return int(described["pid"])
                raise ConnectError(Code.NOT_FOUND, f"process with tag {tag!r} not found")
        raise ConnectError(Code.INVALID_ARGUMENT, "a process selector (pid or tag) is required")

    async def _stream(
        self,
        ctx: RequestContext[Any, Any],
        pid: int,
        events: AsyncIterator[Event],
        pty: bool,
        wrap: Callable[[pb.ProcessEvent], Any],
    ) -> AsyncIterator[Any]:
        yield wrap(pb.ProcessEvent(event=one("start", pb.ProcessEvent.StartEvent(pid=pid))))
        async for event in _with_keepalive(events, _keepalive_s(ctx)):
            if event is None:
                keepalive = pb.ProcessEvent.KeepAlive()
                yield wrap(pb.ProcessEvent(event=one("keepalive", keepalive)))
            elif not (isinstance(event, Output) and not event.data):
                yield wrap(_event(event, pty))

    async def start(
        self, request: pb.StartRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pb.StartResponse]:
        where = self.reach(ctx)
        config = request.process or pb.ProcessConfig()
        if not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        size = request.pty.size if request.pty is not None else None
        pty = (size.cols or 80, size.rows or 24) if size is not None else None
        timeout_ms = ctx.timeout_ms
        spec = CommandSpec(
            cmd=config.cmd,
            args=tuple(config.args or ()),
            cwd=config.cwd or None,
            env=dict(config.envs or {}),
            user=where.user,
            timeout_s=timeout_ms / 1000 if timeout_ms else None,
            stdin=request.stdin if request.has_field("stdin") else True,
            tag=request.tag if request.has_field("tag") else None,
            pty=pty,
        )
        pid, events = await call(
            where.manager.open_command(where.id, spec, owner=where.owner, front_end=FRONT_END)
        )

        def wrap(event: pb.ProcessEvent) -> pb.StartResponse:
            return pb.StartResponse(event=event)

        async for response in self._stream(ctx, pid, events, pty is not None, wrap):
            yield response

    async def connect(
        self, request: pb.ConnectRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pb.ConnectResponse]:
        where = self.reach(ctx)
        pid = await call(self._pid(ctx, request.process))
        described = await call(where.manager.commands(where.id, where.owner))
        pty = any(p.get("pid") == pid and p.get("pty") for p in described)
        events = await call(where.manager.watch_command(where.id, pid, where.owner))

        def wrap(event: pb.ProcessEvent) -> pb.ConnectResponse:
            return pb.ConnectResponse(event=event)

        async for response in self._stream(ctx, pid, events, pty, wrap):
            yield response

    async def list(self, request: pb.ListRequest, ctx: RequestContext[Any, Any]) -> pb.ListResponse:
        where = self.reach(ctx)
        found = await call(where.manager.commands(where.id, where.owner))
        processes = []
        for described in found:
            argv = [str(a) for a in described.get("argv") or [described.get("cmd") or ""]]
            env = described.get("env") or {}
            config = pb.ProcessConfig(
                cmd=argv[0],
                args=argv[1:],
                envs={str(k): str(v) for k, v in env.items()},
                cwd=described.get("cwd"),
            )
            tag = described.get("tag")
            info = pb.ProcessInfo(config=config, pid=int(described["pid"]), tag=tag)
            processes.append(info)
        return pb.ListResponse(processes=processes)

    async def _input(self, ctx: RequestContext[Any, Any], selector: Any, given: Any) -> None:
        where = self.reach(ctx)
        pid = await call(self._pid(ctx, selector))
        data = given.input.value if given is not None and given.input is not None else b""
        await call(where.manager.command_input(where.id, pid, bytes(data), owner=where.owner))

    async def send_input(
        self, request: pb.SendInputRequest, ctx: RequestContext[Any, Any]
    ) -> pb.SendInputResponse:
        await self._input(ctx, request.process, request.input)
        return pb.SendInputResponse()

    async def stream_input(
        self, requests: AsyncIterator[pb.StreamInputRequest], ctx: RequestContext[Any, Any]
    ) -> pb.StreamInputResponse:
        selector = None
        async for request in requests:
            event: Any = request.event
            match event:
                case Oneof(field="start", value=start):
                    selector = start.process
                case Oneof(field="data", value=data):
                    if selector is None:
                        raise ConnectError(Code.INVALID_ARGUMENT, "input before the start event")
                    await self._input(ctx, selector, data.input)
        return pb.StreamInputResponse()

    async def send_signal(
        self, request: pb.SendSignalRequest, ctx: RequestContext[Any, Any]
    ) -> pb.SendSignalResponse:
        where = self.reach(ctx)
        pid = await call(self._pid(ctx, request.process))
        if request.signal == pb.Signal.SIGKILL:
            await call(where.manager.kill_command(where.id, pid, where.owner))
        elif request.signal == pb.Signal.SIGTERM:
            await call(where.manager.signal_command(where.id, pid, signal.SIGTERM, where.owner))
        else:
            raise ConnectError(Code.INVALID_ARGUMENT, "signal: SIGNAL_SIGTERM or SIGNAL_SIGKILL")
        return pb.SendSignalResponse()

    async def close_stdin(
        self, request: pb.CloseStdinRequest, ctx: RequestContext[Any, Any]
    ) -> pb.CloseStdinResponse:
        where = self.reach(ctx)
        pid = await call(self._pid(ctx, request.process))
        await call(where.manager.command_input(where.id, pid, b"", eof=True, owner=where.owner))
        return pb.CloseStdinResponse()

    async def update(
        self, request: pb.UpdateRequest, ctx: RequestContext[Any, Any]
    ) -> pb.UpdateResponse:
        where = self.reach(ctx)
        pid = await call(self._pid(ctx, request.process))
        size = request.pty.size if request.pty is not None else None
        if size is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "pty.size is required")
        await call(where.manager.resize_terminal(where.id, pid, size.cols, size.rows, where.owner))
        return pb.UpdateResponse()
