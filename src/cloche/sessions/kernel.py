"""The host's side of one kernel's channel: send cells, collect what they produce.

Whatever the kernel sends is untrusted: the kernel shares its process with the user's
code, which can write anything to the channel. Every message is validated (`messages.py`)
and bounded (the cell's in `inflight.py`); a kernel that breaks the protocol loses its
sandbox, and only its own.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cloche.config import MIB, Limits
from cloche.errors import InvalidMessage, KernelDied, ProtocolError, SandboxStartError
from cloche.protocol.framing import FrameDecoder, decode_body, encode_frame
from cloche.sandbox.base import CRASH_STARTS, ExitStep, Sandbox
from cloche.sessions.hookups import LLMRequests
from cloche.sessions.inflight import Cell, Stage
from cloche.sessions.messages import parse_input_request
from cloche.sessions.processes import ProcessTable
from cloche.sessions.result import CellResult, CellStatus
from cloche.sessions.supervisor_link import SupervisorLink

if TYPE_CHECKING:
    from cloche.packages.bridge import KernelPip

log = logging.getLogger("cloche.kernel")

EventCallback = Callable[[dict[str, Any]], None]


_BETWEEN_CELLS_BUDGET = 64 * MIB
# Run silently in a kernel restored from a checkpoint, before anyone uses it: every clone of
# one image would otherwise draw the same "random" numbers. (The str hash seed is fixed at
# interpreter start-up and stays the template's.)
AFTER_RESTORE = (
    "import random, sys\n"
    "random.seed()\n"
    "if 'numpy' in sys.modules:\n"
    "    sys.modules['numpy'].random.seed()\n"
)


class _ChannelProtocol(asyncio.Protocol):
    def __init__(self, client: KernelClient, max_frame_bytes: int) -> None:
        self.client = client
        self.decoder = FrameDecoder(max_frame_bytes)

    def data_received(self, data: bytes) -> None:
        if self.client.killing:
            return  # nothing more from this kernel is believed
        try:
            for body in self.decoder.feed(data):
                self.client._dispatch(decode_body(body))
        except ProtocolError as exc:
            self.client._violation(str(exc))

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._channel_closed()


class KernelClient:
    """A started kernel in a sandbox, and the cells sent to it (one at a time)."""

    def __init__(self, sandbox: Sandbox, limits: Limits, max_frame_bytes: int) -> None:
        self.sandbox = sandbox
        self.limits = limits
        self.max_frame_bytes = max_frame_bytes
        self.alive = False
        self.death: str | None = None  # why it died, when it did
        # ... in a word (CellResult.killed_by): killed, memory, sandbox_died
        self.death_reason = "sandbox_died"
        self.settled = asyncio.Event()  # set once its death (if any) is explained
        self._ready: asyncio.Future[None] | None = None
        self._writer: asyncio.WriteTransport | None = None
        self._reader: asyncio.ReadTransport | None = None
        self._cell: Cell | None = None
        self._closed: asyncio.Future[None] | None = None
        self._between_cells_chars = 0
        self._exit_step: ExitStep | None = None
        self.killing = False
        self.llm: LLMRequests | None = None  # answers the cells' llm_query, when configured
        # A kernel restored from an image reseeds its random numbers first (a copy of a
        # session must not draw the same ones); a paused session resumed goes on exactly.
        self.reseed = True
        self.pip: KernelPip | None = None  # answers the cells' `%pip install`
        # The sandbox's commands and terminals, beside the cells (`kernel.procd`), through
        # a link of their own.
        self.supervisor = SupervisorLink(
            sandbox.id, max_frame_bytes, self._from_supervisor, self._supervisor_gone
        )
        self.processes = ProcessTable(self.supervisor.send)

    @property
    def id(self) -> str:
        return self.sandbox.id

    async def start(self, timeout_s: float = 60.0) -> None:
        """Launch the sandbox and wait for its kernel to say it is ready.

        Raises:
            SandboxStartError: it did not start, or did not answer within timeout_s.
        """
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._closed = loop.create_future()
        launch = asyncio.ensure_future(asyncio.to_thread(self.sandbox.launch))
        try:
            await asyncio.shield(launch)
        except asyncio.CancelledError:
            # The launch thread can't be cancelled: let it finish, then undo it.
            await asyncio.gather(launch, return_exceptions=True)
            await self.close()
            raise
        try:
            self._reader, _ = await loop.connect_read_pipe(
                lambda: _ChannelProtocol(self, self.max_frame_bytes), self.sandbox.stdout
            )
            self._writer, _ = await loop.connect_write_pipe(asyncio.Protocol, self.sandbox.stdin)
            if self.sandbox.restore_from is not None:
                await self._restored(timeout_s)
            else:
                async with asyncio.timeout(timeout_s):
                    await self._ready
                await asyncio.to_thread(self.sandbox.started)
            self._link_supervisor()
        except BaseException as exc:
            await self.close()
            if isinstance(exc, TimeoutError):
                raise SandboxStartError(
                    f"sandbox {self.id} did not answer within {timeout_s:g} s "
                    "(--sandbox-start-timeout)"
                ) from exc
            if isinstance(exc, KernelDied):
                raise SandboxStartError(f"sandbox {self.id} exited while starting: {exc}") from exc
            raise
        self.alive = True

    def _link_supervisor(self) -> None:
        """Have the supervisor connect to the host (a pool's template sandbox, saved at once
        and never given a command, is not linked: its clones are, when restored)."""
        sandbox = self.sandbox
        if sandbox.for_clones:
            return
        if sandbox.door_dir is None or sandbox.door_inside is None:
            self.supervisor.gone("this sandbox has no door for its process supervisor")
            return
        self.supervisor.open(sandbox.door_dir, sandbox.door_inside, self.send)

    async def rest_supervisor(self) -> None:
        """Before a checkpoint: the supervisor lets its spare leader go and ends its link to
        the host (`relink_supervisor` after, if the sandbox runs on)."""
        self.sandbox.thaw()  # an idle session's is frozen: thawed, it answers
        await self.supervisor.rest(self.processes.rest)

    def relink_supervisor(self) -> None:
        if self.alive:
            self.supervisor.relink()

    def _from_supervisor(self, message: dict[str, Any]) -> None:
        if message.get("op") == "proc.note":  # what it wants the host's log to have
            log.warning("sandbox %s: its supervisor says %.300s", self.id, message.get("why"))
            return
        self.processes.on_message(message)

    def _supervisor_gone(self, why: str) -> None:
        self.processes.lost(why)

    async def _restored(self, timeout_s: float) -> None:
        """A restored kernel said it was ready before its checkpoint; its first cell is the
        proof that it runs, and reseeds its random numbers."""
        assert self._ready is not None
        self._ready.set_result(None)
        self.alive = True
        code = AFTER_RESTORE if self.reseed else "pass"
        result = await self.execute(code, timeout_s=timeout_s, silent=True)
        if result.status is not CellStatus.OK:
            why = result.error["evalue"] if result.error else result.message
            raise SandboxStartError(f"sandbox {self.id} did not come back from its image: {why}")
        await asyncio.to_thread(self.sandbox.started)  # runsc knows its pid by now

    async def execute(
        self,
        code: str,
        *,
        timeout_s: float,
        output_limit: int | None = None,
        on_event: EventCallback | None = None,
        silent: bool = False,
        stdin: bool = False,
        pager: bool = False,
    ) -> CellResult:
        """Run one cell. Never raises for what the cell did; KernelDied if it can't run.

        A cell over timeout_s is interrupted; one still running `interrupt_grace_s` later
        has its sandbox killed (status KILLED). With stdin, the cell's input() reaches
        on_event as {"type": "input_request", "prompt", "password"}, answered by
        `answer_input`; without, input() raises in the cell. With pager, `obj?` reaches
        on_event as {"type": "page", "text"} (a Jupyter client's pager) instead of stdout.
        """
        if not self.alive or self._writer is None:
            raise KernelDied(self.death or f"sandbox {self.id} is not running")
        assert self._cell is None, "one cell at a time: the session serialises cells"
        self.sandbox.thaw()  # if the session sat idle long enough to be frozen
        limit = output_limit if output_limit is not None else self.limits.output_bytes
        cell = Cell(timeout_s, limit, on_event, stdin and on_event is not None)
        loop = asyncio.get_running_loop()
        cell.timer = loop.call_later(timeout_s, self._on_deadline, cell)
        self._cell = cell
        message = {"op": "exec", "code": code, "output_limit": limit}
        if silent:
            message["silent"] = True
        if cell.stdin:
            message["stdin"] = True
        if pager and on_event is not None:
            message["pager"] = True
        self._writer.write(encode_frame(message))
        try:
            await asyncio.shield(cell.future)
        except asyncio.CancelledError:
            # The caller gave up (shutdown, or its client went away). Stop the cell, and
            # wait for its end (bounded by the interrupt -> grace -> kill ladder), so the
            # next cell never meets this one's messages.
            self.interrupt()
            while not cell.future.done():
                try:
                    await asyncio.shield(cell.future)
                except asyncio.CancelledError:
                    continue
            raise
        finally:
            cell.timer.cancel()
            if self.llm is not None:
                self.llm.end(cell)
            if self.pip is not None:
                self.pip.end(cell)
            if self._cell is cell:
                self._cell = None
        return cell.result

    @property
    def stopping(self) -> bool:
        """Whether the cell in flight has been told to stop (a timeout or an interrupt)."""
        return self._cell is not None and self._cell.stage is not Stage.RUNNING

    def interrupt(self) -> bool:
        """Interrupt the running cell, if any (escalating to a kill after the grace)."""
        cell = self._cell
        if cell is None or cell.stage is not Stage.RUNNING:
            return False
        self._signal(cell, CellStatus.INTERRUPTED)
        return True

    def answer_input(self, value: str) -> bool:
        """Give the running cell's input() its value; False if no input() is waiting."""
        cell = self._cell
        if cell is None or cell.asking is None or cell.stage is not Stage.RUNNING:
            return False
        self.send({"op": "input_reply", "id": cell.asking, "value": value})
        cell.asking = None
        return True

    def _on_deadline(self, cell: Cell) -> None:
        if cell.future.done():
            return
        if cell.stage is Stage.RUNNING:
            self._signal(cell, CellStatus.TIMEOUT)
        elif cell.stage is Stage.INTERRUPTING:
            cell.stage = Stage.KILLING
            grace = self.limits.interrupt_grace_s
            why = (
                f"the cell exceeded its time limit of {cell.timeout_s:g} s (--cell-timeout)"
                if cell.reason is CellStatus.TIMEOUT
                else "the cell was interrupted"
            )
            if self.death is None:
                self.death_reason = "killed"
            self._kill(f"{why} and did not stop within {grace:g} s of the interrupt")

    def _signal(self, cell: Cell, reason: CellStatus) -> None:
        cell.stage = Stage.INTERRUPTING
        cell.reason = reason
        if cell.timer is not None:
            cell.timer.cancel()
        loop = asyncio.get_running_loop()
        cell.timer = loop.call_later(self.limits.interrupt_grace_s, self._on_deadline, cell)
        # Behind the host's processes, a busy machine could starve the cell past the grace.
        self.sandbox.level_with_the_host()
        loop.run_in_executor(None, self.sandbox.interrupt)
        if self.llm is not None:  # a call in flight is answered now, so the cell can stop
            self.llm.stop(cell, f"the cell was interrupted ({reason.value})", interrupted=True)
        if self.pip is not None:
            self.pip.stop(cell)
        if cell.asking is not None:  # input() waiting: it raises KeyboardInterrupt now
            self.send(
                {
                    "op": "input_reply",
                    "id": cell.asking,
                    "error": "interrupted",
                    "interrupted": True,
                }
            )
            cell.asking = None

    def _kill(self, why: str) -> None:
        if self.death is None:
            self.death = why
        self.killing = True
        self.alive = False  # no new cell goes to a kernel that is being killed
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, self.sandbox.kill)
        loop.call_later(10.0, self._lost)  # in case the channel never closes

    def hold_deadline(self, cell: Cell, held: bool) -> None:
        """Stop the cell's clock while it waits for an LLM's answer, or restart it."""
        if cell.future.done() or cell.stage is not Stage.RUNNING or cell.timer is None:
            return
        loop = asyncio.get_running_loop()
        if held and cell.held_s is None:
            cell.held_s = max(0.0, cell.timer.when() - loop.time())
            cell.timer.cancel()
        elif not held and cell.held_s is not None:
            cell.timer = loop.call_later(cell.held_s, self._on_deadline, cell)
            cell.held_s = None

    def send(self, message: dict[str, Any]) -> None:
        """Write a message to the kernel (the answer to an LLM request)."""
        if self._writer is not None and not self.killing and not self._writer.is_closing():
            self._writer.write(encode_frame(message))

    # -- messages from the kernel -------------------------------------------------------

    def _dispatch(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        cell = self._cell
        if op == "stream":
            self._on_stream(cell, message)
        elif op == "display":
            if cell is not None:
                cell.display(message.get("data"))
        elif op == "page":
            if cell is not None:
                cell.page(message.get("text"))
        elif op == "done":
            if cell is None:
                raise InvalidMessage("end of a cell that was never sent")
            self._on_done(cell, message)
        elif op == "llm":
            if cell is None or self.llm is None:
                raise InvalidMessage("an LLM request outside a cell, or without an LLM backend")
            self.llm.request(cell, message)
        elif op == "pip":
            if cell is None:
                raise InvalidMessage("a pip request outside a cell")
            if self.pip is None:
                self.send({"op": "pip_reply", "id": message.get("id"), "error": "no installer"})
            else:
                self.pip.request(cell, message)
        elif op == "input":
            self._on_input(cell, message)
        elif op == "proc.gone":  # the kernel could not pass `proc.link` on
            why = message.get("why")
            self.supervisor.gone(why[:300] if isinstance(why, str) else "no process supervisor")
        elif op == "ready":
            if self._ready is None or self._ready.done():
                raise InvalidMessage("a second ready message")
            self._ready.set_result(None)
        else:
            raise InvalidMessage(f"unknown message {str(op)[:40]!r}")

    def _on_input(self, cell: Cell | None, message: dict[str, Any]) -> None:
        if cell is None:
            raise InvalidMessage("an input request outside a cell, or with unknown fields")
        request_id, prompt, password = parse_input_request(message)
        if not cell.ask(request_id, prompt, password):
            why = "no client answers prompts for this cell, or one is already waiting"
            self.send({"op": "input_reply", "id": request_id, "error": why})

    def _on_stream(self, cell: Cell | None, message: dict[str, Any]) -> None:
        name, text = message.get("name"), message.get("text")
        if name not in ("stdout", "stderr") or not isinstance(text, str):
            raise InvalidMessage("malformed stream message")
        if cell is None:
            # Output of background threads between cells: nobody to give it to.
            self._between_cells_chars += len(text)
            if self._between_cells_chars > _BETWEEN_CELLS_BUDGET:
                raise InvalidMessage("output flood between cells")
            return
        cell.stream(name, text)

    def _on_done(self, cell: Cell, message: dict[str, Any]) -> None:
        cell.end(message, self.limits.memory_mib)
        if not self.alive and self.death is not None:  # ended by `close`: the session is gone
            cell.result.error = cell.result.result = None
            cell.gone(self.death, self.death_reason)
        cell.tell_truncation()
        cell.future.set_result(None)

    def _violation(self, why: str) -> None:
        if self.death is None:
            log.warning("sandbox %s broke the channel protocol: %s", self.id, why)
            self._kill(f"the kernel broke the channel protocol ({why})")

    def _channel_closed(self) -> None:
        """The kernel's end closed. Unless we caused it, learn why before telling anyone."""
        self.alive = False
        if self.death is not None:
            self._lost()
            return
        task = asyncio.ensure_future(self._explain_exit())
        task.add_done_callback(lambda _: self._lost())

    async def _explain_exit(self) -> None:
        process = self.sandbox.process
        code = None
        if process is not None:
            try:
                code = await asyncio.to_thread(process.wait, 2.0)
            except subprocess.TimeoutExpired:
                pass
        if self.death is not None:
            return
        if code in (137, -signal.SIGKILL) and await asyncio.to_thread(self.sandbox.oom_killed):
            self.death_reason = "memory"
            self.death = (
                "the sandbox was killed by the memory cgroup's OOM killer: its processes "
                f"together went over the memory backstop of {self.limits.cgroup_memory_mib} MiB "
                "(raise it with --memory-mib)"
            )
        elif code in (137, -signal.SIGKILL):
            self.death = (
                "the sandbox was killed by SIGKILL: by its own code, or by the memory backstop "
                f"of {self.limits.cgroup_memory_mib} MiB that its processes together must stay "
                "under (raise it with --memory-mib)"
            )
        else:  # what runsc said goes to the host's log only; its users learn that it did
            said = await asyncio.to_thread(self.sandbox.runtime_log)
            why = [] if code is None else [f"exit status {code}"]
            if said.startswith(CRASH_STARTS):
                why.append("gVisor's kernel crashed, the server's log has its report")
            self.death = "the sandbox exited unexpectedly" + (f" ({': '.join(why)})" * bool(why))
            log.warning("sandbox %s: %s; runsc: %s", self.id, self.death, said or "-")

    def _lost(self) -> None:
        """The channel closed: the sandbox is dead or being killed."""
        self.settled.set()
        self.alive = False
        if self.death is None:
            self.death = "the sandbox exited unexpectedly"
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(KernelDied(self.death))
        self.processes.lost(self.death)
        self.supervisor.close()
        cell = self._cell
        if cell is not None and not cell.future.done():
            cell.gone(self.death, self.death_reason)
            cell.future.set_result(None)
        if self._reader is not None:
            self._reader.close()
        if self._writer is not None:
            self._writer.close()

    async def close(self, grace_s: float = 2.0, why: str = "the session was closed") -> ExitStep:
        """End the sandbox (close, then kill if needed) and free everything. Idempotent.

        A cell still running ends as KILLED, its message saying `why`.
        """
        running = self.alive  # not dead already: whatever ends it now is this close
        self.alive = False
        if self.death is None:
            self.death = why
        cell = self._cell
        if cell is not None and not cell.future.done() and not self.killing:
            # A kernel busy in a cell (asleep, say) reads no EOF: interrupt the cell and wait
            # for its end first. The interrupt's own ladder bounds the wait (kill after
            # interrupt_grace_s, channel given up 10 s later), so it never hangs.
            if cell.stage is Stage.RUNNING:
                self._signal(cell, CellStatus.INTERRUPTED)
            await asyncio.shield(cell.future)
        self.supervisor.close()
        if self._writer is not None:
            self._writer.close()  # the kernel reads EOF and exits
        if self._reader is not None:
            self._reader.close()  # before the sandbox's pipes are closed under it
        if self._exit_step is None:
            step = await asyncio.to_thread(self.sandbox.close, grace_s)
            if self.killing and step is ExitStep.CLOSED:
                step = ExitStep.KILLED  # by the interrupt's ladder, while the close waited
            elif running and step is ExitStep.EXITED:
                step = ExitStep.CLOSED  # it read the EOF and was gone before the ladder looked
            self._exit_step = step
        return self._exit_step
