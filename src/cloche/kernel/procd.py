"""The process supervisor: the session's commands and terminals, beside its kernel.

The kernel starts it before it gives up root (`main.py`), so that a command may run as root
inside the sandbox while cells never do (with --no-root, commands run as the session's
user only). It talks to the host over a connection of its own to the sandbox's door
(`framing.HostLink`), asked for through the kernel (`proc.link`, at start and after each
restore) and ended after each `proc.rest` (before each checkpoint); the kernel reads the
host's frames itself. It is the sandbox's subreaper: what a command leaves is reaped.

    kernel -> supervisor {"op": "proc.link", "path", "token"}   (connect to the host there)
    host -> supervisor  {"op": "proc.start", "rid", "argv", "cwd", "env", "user", "stdin",
                          "pty": null | {"cols", "rows"}, "tag", "cmd"}
                        {"op": "proc.input", "rid", "pid", "data": base64}
                        {"op": "proc.eof" | "proc.kill" | "proc.hangup", "rid", "pid"}
                        {"op": "proc.signal", "rid", "pid", "signal": int}
                        {"op": "proc.resize", "rid", "pid", "cols", "rows"}
                        {"op": "proc.list", "rid"}
                        {"op": "proc.fs", "rid", "user", "do", ...}  (kernel/files.py)
                        {"op": "proc.ack", "pid", "bytes"}   (output taken: send more)
                        {"op": "proc.rest", "rid"}   (a checkpoint comes: no spare leader,
                                                      and the connection ends)
                        {"op": "ports.open" | "ports.shut", ...}   (the ports' relay: `ports`)
    supervisor -> host  {"op": "proc.reply", "rid", ...result | "error": str}
                        {"op": "proc.out", "pid", "fd": 1 | 2, "data": base64}
                        {"op": "proc.exit", "pid", "exit_code": int | null, "signal": int | null}
                        {"op": "proc.note", "why"}   (a failure for the host's log)

Output goes out in pieces until `spawn.WINDOW` bytes of a process are unacknowledged; then
it waits (its writes block, as on a slow terminal) for the host's acknowledgement. A
process has ended when its leader has and its streams are drained; streams still held
open by what it left running are read and dropped, so nothing it left gets SIGPIPE.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import os
import selectors
import signal
import time
from collections.abc import Callable

from . import files, ports, spawn
from .framing import HELLO, FramedLink, HostLink

TYPE_CHECKING = False  # typing is not imported: the supervisor stays small
if TYPE_CHECKING:
    import socket
    from typing import Any

_CHUNK = 64 * 1024
_HANGUP_GRACE_S = 2.0  # a hung-up terminal's processes get this long before SIGKILL
_PR_SET_CHILD_SUBREAPER = 36
_IDLE_S = 0.05  # nothing to do for this long: the next command's leader is forked


class Supervisor:
    """One select loop over the kernel's socket, the host's, every process's streams and
    SIGCHLD."""

    def __init__(self, kernel: socket.socket) -> None:
        self.kernel = FramedLink(kernel)
        self.host = HostLink()
        self.selector = selectors.DefaultSelector()
        self.processes: dict[int, spawn.Running] = {}  # running, by pid
        self.streams: dict[int, spawn.Running] = {}  # fd -> the process it belongs to
        self.orphans: set[int] = set()  # streams of ended processes, still held by others
        self.timers: list[tuple[float, Callable[[], object]]] = []
        # A leader forked ahead of the next command, once commands have been asked for
        # (made when the supervisor is idle, off any start's path; a session of cells only
        # has none).
        self.spare: spawn.Spare | None = None
        self.commands_asked = False
        self.relay: ports.Relay | None = None  # from the first port request to a shut
        self.waker_r, self.waker_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.waker_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(number, signal.SIG_IGN)
        self.selector.register(kernel, selectors.EVENT_READ)
        self.selector.register(self.waker_r, selectors.EVENT_READ)
        self.handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any] | None]] = {
            "proc.start": self._start,
            "proc.input": self._input,
            "proc.eof": self._eof,
            "proc.signal": self._signal,
            "proc.kill": self._kill,
            "proc.hangup": self._hangup,
            "proc.resize": self._resize,
            "proc.list": self._list,
            "proc.fs": files.run,  # files as a user (kernel/files.py)
            "proc.rest": self._rest,
            "ports.open": self._ports,
            "ports.shut": self._ports,
            "proc.link": self._link,
        }

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        self.kernel.send(HELLO)  # up and serving: the kernel says it is ready only after this
        while True:
            timeout = None
            if self.timers:
                timeout = max(0.0, min(when for when, _ in self.timers) - time.monotonic())
            refill = self.commands_asked and self.spare is None
            if refill:
                timeout = _IDLE_S if timeout is None else min(timeout, _IDLE_S)
            if self.relay is not None and (retry := self.relay.timeout()) is not None:
                timeout = retry if timeout is None else min(timeout, retry)
            ready = self.selector.select(timeout)
            if refill and not ready:
                self._refill()
            relay_fd = -1 if self.relay is None else self.relay.fileno()
            if self.relay is not None and (
                self.relay.timeout() == 0 or any(key.fd == relay_fd for key, _ in ready)
            ):
                self.relay.step()
            for key, mask in ready:
                fd = key.fd
                if fd == relay_fd:
                    continue
                if fd == self.kernel.fileno():
                    self._on_kernel()
                elif self.host.link is not None and fd == self.host.link.fileno():
                    self._on_host(mask)
                elif fd == self.waker_r:
                    self._on_signal()
                elif fd in self.orphans:
                    self._drop(fd)
                elif fd in self.streams:
                    self._on_stream(self.streams[fd], fd, mask)
            now = time.monotonic()
            due = [action for when, action in self.timers if when <= now]
            self.timers = [(when, action) for when, action in self.timers if when > now]
            for action in due:
                action()

    def _refill(self) -> None:
        """Fork the next command's leader while nothing waits (a fork takes tens of ms)."""
        try:
            self.spare = spawn.Spare()
        except OSError:  # the process limit: the next start forks its own leader
            self.commands_asked = False  # until the next command asks again

    def _watch(self, fd: int, events: int) -> None:
        """Set what the loop waits for on fd (nothing: not watched)."""
        watched = fd in self.selector.get_map()
        if events and watched:
            self.selector.modify(fd, events)
        elif events:
            self.selector.register(fd, events)
        elif watched:
            self.selector.unregister(fd)

    def _update(self, process: spawn.Running) -> None:
        """Watch a process's streams: output unless it waits for an ack, stdin if input waits."""
        fds = set(process.outputs) | ({process.stdin} if process.stdin is not None else set())
        for fd in fds:
            events = 0
            if fd in process.outputs and not process.paused:
                events |= selectors.EVENT_READ
            if fd == process.stdin and process.pending_input:
                events |= selectors.EVENT_WRITE
            self._watch(fd, events)

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self.host.send(message)
        except OSError as exc:  # the connection failed: the host asks for another
            self._unlink(failed=exc)
            self.host.kept.append(message)
        self._watch_host()

    def _watch_host(self) -> None:
        link = self.host.link
        if link is not None:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if link.waiting else 0)
            self._watch(link.fileno(), events)

    def _unlink(self, flush: bool = False, failed: OSError | None = None) -> None:
        if self.host.link is not None:
            self._watch(self.host.link.fileno(), 0)
            self.host.close(flush)
            if failed is not None:  # said on the next link (the host logs it)
                self.host.kept.append({"op": "proc.note", "why": f"its link failed: {failed}"})

    def _on_kernel(self) -> None:
        try:
            frames = self.kernel.receive()
        except OSError:
            frames = None
        if frames is None:
            os._exit(0)  # the kernel has gone: so has the sandbox
        for frame in frames:
            self._handle(frame)

    def _on_host(self, mask: int) -> None:
        link = self.host.link
        assert link is not None
        try:
            if mask & selectors.EVENT_WRITE:
                link.flush()
                self._watch_host()
            frames = link.receive() if mask & selectors.EVENT_READ else []
        except OSError as exc:
            self._unlink(failed=exc)
            return
        if frames is None:
            self._unlink()
            return
        for frame in frames:
            self._handle(frame)

    def _handle(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "proc.ack":
            self._ack(message)
            return
        handler = self.handlers.get(str(op))
        try:
            if handler is None:
                raise ValueError(f"unknown request {op!r}")
            result = handler(message) or {}
        except Exception as exc:  # every request is answered, a failure with its reason
            result = {"error": str(exc) or type(exc).__name__}
        if "rid" in message:
            self._send({"op": "proc.reply", "rid": message["rid"], **result})
        if op == "proc.rest":  # answered: the connection ends before the checkpoint
            self._unlink(flush=True)

    # -- requests ----------------------------------------------------------------------

    def _start(self, request: dict[str, Any]) -> dict[str, Any]:
        argv = request.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError("argv must be a non-empty list of strings")
        user = str(request.get("user") or "user")
        try:
            identity = spawn.Identity.of(user)
        except KeyError:
            raise ValueError(f"no user {user!r} in the sandbox's /etc/passwd") from None
        env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
        env.setdefault("HOME", identity.home)
        env.setdefault("USER", identity.name)
        env.setdefault("LOGNAME", identity.name)
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        pty = request.get("pty")
        size = (int(pty.get("cols", 80)), int(pty.get("rows", 24))) if pty else None
        what = spawn.Start(
            argv=argv,
            cwd=str(request.get("cwd") or identity.home),
            env=env,
            identity=identity,
            stdin=bool(request.get("stdin")),
            pty=size,
        )
        spare = None
        if size is None:  # a command: under the spare leader, if one is ready
            spare, self.spare = self.spare, None
            self.commands_asked = True
        process = spawn.Running(spawn.start(what, spare), request)
        self.processes[process.pid] = process
        for fd in process.outputs:
            self.streams[fd] = process
        if process.stdin is not None:
            self.streams[process.stdin] = process
        self._update(process)
        return {"pid": process.pid}

    def _rest(self, _request: dict[str, Any]) -> None:
        """A checkpoint comes: no spare leader until the next command (a process's size)."""
        if self.spare is not None:
            self.spare.discard()
            with contextlib.suppress(OSError):  # gone before the checkpoint, and reaped
                os.kill(self.spare.pid, signal.SIGKILL)
                os.waitpid(self.spare.pid, 0)
            self.spare = None
        self.commands_asked = False

    def _link(self, request: dict[str, Any]) -> None:  # to the host, at the sandbox's door
        self._unlink()
        link = self.host.connect(str(request.get("path")), str(request.get("token")))
        self._watch(link.fileno(), selectors.EVENT_READ)
        self._watch_host()

    def _ports(self, request: dict[str, Any]) -> dict[str, Any]:
        """For the ports' relay: made at the first `ports.open`, dropped with nothing open."""
        if self.relay is None:
            if request.get("op") == "ports.shut":
                return {"ended": 0}
            self.relay = ports.Relay()
            self.selector.register(self.relay.fileno(), selectors.EVENT_READ)
        try:
            return self.relay.handle(request)
        finally:
            relay = self.relay
            if relay.door is None and not relay.pipes and not relay.dialing:
                self.selector.unregister(relay.fileno())
                relay.close_all()
                self.relay = None

    def _find(self, request: dict[str, Any]) -> spawn.Running:
        process = self.processes.get(request.get("pid"))  # type: ignore[arg-type]
        if process is None:
            raise ProcessLookupError(f"process {request.get('pid')} is not running")
        return process

    def _input(self, request: dict[str, Any]) -> None:
        process = self._find(request)
        if process.stdin is None or process.close_input:
            raise ValueError(f"process {process.pid} takes no input (start it with stdin)")
        process.pending_input += base64.b64decode(str(request.get("data") or ""))
        self._write_input(process)

    def _eof(self, request: dict[str, Any]) -> None:
        process = self._find(request)
        if process.terminal:  # a terminal's end of input is its EOF character
            process.pending_input += b"\x04"
        else:
            process.close_input = True
        self._write_input(process)

    def _signal(self, request: dict[str, Any]) -> None:
        process = self._find(request)
        number = int(request.get("signal", signal.SIGTERM))
        try:
            os.killpg(process.pid, number)
        except ProcessLookupError:
            os.kill(process.pid, number)

    def _kill(self, request: dict[str, Any]) -> dict[str, Any]:
        process = self._find(request)
        return {"killed": spawn.kill_tree(process.pid)}

    def _hangup(self, request: dict[str, Any]) -> None:
        process = self._find(request)
        for member in spawn.tree(process.pid):
            for number in (signal.SIGHUP, signal.SIGCONT):
                try:
                    os.kill(member, number)
                except OSError:
                    pass
        ends = time.monotonic() + _HANGUP_GRACE_S
        self.timers.append((ends, lambda: spawn.kill_tree(process.pid)))

    def _resize(self, request: dict[str, Any]) -> None:
        process = self._find(request)
        if not process.terminal or process.stdin is None:
            raise ValueError(f"process {process.pid} has no terminal")
        spawn.set_size(process.stdin, int(request["cols"]), int(request["rows"]))

    def _list(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"processes": [p.described for p in self.processes.values()]}

    def _ack(self, request: dict[str, Any]) -> None:
        process = self.processes.get(request.get("pid"))  # type: ignore[arg-type]
        if process is not None:
            was_paused = process.paused
            process.unacked = max(0, process.unacked - int(request.get("bytes") or 0))
            if was_paused and not process.paused:
                self._update(process)

    # -- streams -----------------------------------------------------------------------

    def _on_stream(self, process: spawn.Running, fd: int, mask: int) -> None:
        if mask & selectors.EVENT_WRITE and fd == process.stdin:
            self._write_input(process)
        if mask & selectors.EVENT_READ and fd in process.outputs:
            self._read(process, fd)

    def _read(self, process: spawn.Running, fd: int) -> bool:
        """Send one piece of a stream's output; False at its end (then closed) or if empty."""
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return False
        except OSError as exc:  # a terminal whose every holder closed it: EIO
            if exc.errno != errno.EIO:
                raise
            data = b""
        if not data:
            self._close_output(process, fd)
            return False
        process.unacked += len(data)
        self._send(
            {
                "op": "proc.out",
                "pid": process.pid,
                "fd": process.outputs[fd],
                "data": base64.b64encode(data).decode("ascii"),
            }
        )
        if process.paused:
            self._update(process)
        return True

    def _close_output(self, process: spawn.Running, fd: int) -> None:
        del process.outputs[fd]
        if fd == process.stdin:
            process.stdin = None
        self._forget(fd)
        self._maybe_ended(process)

    def _forget(self, fd: int) -> None:
        self._watch(fd, 0)
        self.streams.pop(fd, None)
        os.close(fd)

    def _drop(self, fd: int) -> None:
        """Read and drop what an ended process's leftovers write, until they close it."""
        try:
            while os.read(fd, _CHUNK):
                pass
            end = True
        except BlockingIOError:
            end = False
        except OSError:
            end = True
        if end:
            self.orphans.discard(fd)
            self._watch(fd, 0)
            os.close(fd)

    def _write_input(self, process: spawn.Running) -> None:
        fd = process.stdin
        if fd is None:
            process.pending_input = b""
            return
        try:
            while process.pending_input:
                written = os.write(fd, process.pending_input)
                process.pending_input = process.pending_input[written:]
        except BlockingIOError:
            pass
        except OSError:  # the process closed its end: what it did not read is lost
            process.pending_input = b""
        if not process.pending_input and process.close_input and not process.terminal:
            process.stdin = None
            self._forget(fd)
        else:
            self._update(process)

    # -- ends --------------------------------------------------------------------------

    def _on_signal(self) -> None:
        try:
            while os.read(self.waker_r, 512):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            process = self.processes.get(pid)
            if process is not None:  # else an orphan that came back to us: reaped, forgotten
                process.status = status
                self._maybe_ended(process)

    def _maybe_ended(self, process: spawn.Running) -> None:
        """Once the leader is reaped: send what its streams hold, leave them, tell its end."""
        if process.status is None or process.pid not in self.processes:
            return
        del self.processes[process.pid]
        for fd in list(process.outputs):
            while fd in process.outputs and self._read(process, fd):
                pass
        for fd in process.outputs:
            self.streams.pop(fd, None)
            self.orphans.add(fd)
            self._watch(fd, selectors.EVENT_READ)
        if process.stdin is not None and process.stdin not in process.outputs:
            self._forget(process.stdin)
        process.outputs.clear()
        process.stdin = None
        code, number = spawn.exit_of(process.status)
        self._send({"op": "proc.exit", "pid": process.pid, "exit_code": code, "signal": number})
        if process.terminal:  # its session ends with its shell, as at a hang-up
            spawn.kill_tree(process.pid)


def run(link: socket.socket) -> None:
    """The supervisor's life (in the process the kernel forked)."""
    try:
        import ctypes  # only here: it weighs on the supervisor's every checkpoint

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (ImportError, OSError, AttributeError):
        pass
    try:
        Supervisor(link).run()
    finally:
        os._exit(0)
