"""The kernel's entry point: set up the channel and output capture, then serve cells.

Started by the host as (see `cloche.sandbox.base.kernel_command`):
    python -I -S -B -c <bootstrap> <dir holding cloche/kernel> [extra sys.path entries...]
"""

from __future__ import annotations

import _sitebuiltins
import builtins
import json
import math
import os
import signal
import socket
import sys
import time
from typing import Any

from . import introspect
from .capture import OutputCapture
from .channel import Channel
from .display import as_json, mime_bundle
from .executor import Executor, format_error
from .figures import FigureCapture
from .fonts import link_font_list
from .llm import Bridge
from .pip import Pip
from .router import Router, await_supervisor, drop_privileges
from .stdin import Prompter


class Kernel:
    """One interpreter's worth of state: namespace, capture, and the channel to the host."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.capture = OutputCapture(channel)
        self.executor = Executor()
        introspect.bind(self.executor)  # for the host's complete, inspect and history asks
        self.in_cell = False
        self.output_limit = 1 << 20
        self.figures = FigureCapture(self._send_display)
        self.llm = Bridge(channel, self.executor.namespace)  # llm_query, once installed
        self.pip = Pip(self.llm)  # `%pip install`, through the same reader of the channel
        self.prompter = Prompter(self.llm)  # input() and getpass(), likewise
        self.prompter.install()
        signal.signal(signal.SIGINT, self._on_sigint)
        builtins.display = self.display  # type: ignore[attr-defined]
        # What `site` would add (the kernel runs with -S): exit(), quit(), help().
        builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
        builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
        builtins.help = _sitebuiltins._Helper()

    def _on_sigint(self, signum: int, frame: object) -> None:
        # The host interrupts only a running cell; one that arrives after the cell ended
        # (a race with the host's timer) must not hit the kernel's own code.
        if self.in_cell and not self.llm.hold_interrupt():
            raise KeyboardInterrupt

    def _set_in_cell(self, flag: bool) -> None:
        self.in_cell = flag
        self.llm.cell(flag)  # at the end, waits for replies owed to the cell's threads

    def display(self, *objects: Any) -> None:
        """Show objects as rich output of the running cell, as Jupyter's display() does."""
        for obj in objects:
            self._send_display(mime_bundle(obj, self.output_limit))

    def _send_display(self, bundle: dict[str, Any]) -> None:
        self.capture.end_cell()  # keep the order: output printed before the display comes first
        self.channel.send({"op": "display", "data": bundle})

    def _send_page(self, text: str) -> None:
        self.capture.end_cell()  # keep the order, as a display does
        self.channel.send({"op": "page", "text": text})

    def serve(self, router: Router) -> None:
        self.llm.route = router.route  # what a caller waiting for a reply reads meanwhile
        self.channel.send({"op": "ready", "pid": os.getpid()})
        while (message := self.channel.recv()) is not None:
            if message.get("op") != "exec":
                router.route(message)
            else:
                self.prompter.allowed = message.get("stdin") is True
                pager = self._send_page if message.get("pager") is True else None
                self.executor.shell.pager = pager
                self.execute(
                    str(message.get("code", "")),
                    int(message.get("output_limit", 1 << 20)),
                    silent=bool(message.get("silent")),
                )

    def execute(self, code: str, output_limit: int, *, silent: bool = False) -> None:
        """Run a cell and send what it produced, then its end marker.

        A silent cell (a profile's preloading) runs in a namespace of its own and is not
        counted; only the modules it imports stay behind.
        """
        self.output_limit = output_limit
        self.capture.begin_cell(output_limit)
        started = time.perf_counter()
        outcome = self.executor.run(code, self._set_in_cell, silent=silent)
        try:
            self.figures.flush()  # after a preload, this takes over pyplot.show()
        except BaseException:  # noqa: S110  # rendering is best effort
            pass
        duration_ms = (time.perf_counter() - started) * 1000
        reply: dict[str, Any] = {
            "op": "done",
            "status": "ok",
            "result": None,
            "error": None,
            "execution_count": self.executor.execution_count,
            "duration_ms": duration_ms,
        }
        try:
            if outcome.exception is not None:
                reply["status"] = "error"
                reply["error"] = format_error(outcome.exception)
            elif outcome.has_value:
                reply["result"] = self._result(outcome.value)
        except BaseException as exc:  # a hostile __repr__ is the user's error, not ours
            reply["status"] = "error"
            reply["result"] = None
            reply["error"] = format_error(exc)
        reply["dropped_bytes"] = self.capture.end_cell()
        self.channel.send(reply)
        self.capture.repair()
        self.executor.end_cell()

    def _result(self, value: Any) -> dict[str, Any]:
        result: dict[str, Any] = {"data": mime_bundle(value, self.output_limit)}
        native, json_value = as_json(value)
        # The value as JSON goes along only within the output limit (a 20 MB string would
        # make a frame the host must refuse), and only if it can be encoded at all (an int
        # of more than 4300 digits can't).
        if native and _json_size(json_value) <= self.output_limit:
            result["json"] = json_value
        return result


def _json_size(value: Any) -> float:
    try:
        return len(json.dumps(value, ensure_ascii=False))
    except (ValueError, RecursionError):
        return math.inf


# The supervisor's interpreter: a fresh one, not a copy of the kernel. gVisor saves each
# process's pages in the sandbox's checkpoints, and a forked copy of the kernel weighs about
# as much as the kernel, whatever it then does. argv: fd of its socket, dir holding cloche/.
_SUPERVISOR = (
    "import socket,sys,types;"
    "m=types.ModuleType('cloche');m.__path__=[sys.argv[2]+'/cloche'];sys.modules['cloche']=m;"
    "from cloche.kernel import procd;procd.run(socket.socket(fileno=int(sys.argv[1])))"
)
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _interpreter() -> list[str]:
    """How the kernel's interpreter was run: its command line up to its own flags (through
    the host's loader, in an image without python3: `cloche.sandbox.interpreter`)."""
    with open("/proc/self/cmdline", "rb") as cmdline:
        argv = [os.fsdecode(arg) for arg in cmdline.read().split(b"\0")]
    return argv[: argv.index("-I")] if "-I" in argv[1:] else [sys.executable]


def start_supervisor() -> socket.socket | None:
    """Start the process supervisor (it keeps root where the sandbox gives it), then become
    the session's user for good: `CLOCHE_USER` is "uid:gid:home". None when it can't fork."""
    uid, gid, home = (os.environ.pop("CLOCHE_USER", "") or f"{os.getuid()}:{os.getgid()}:").split(
        ":", 2
    )
    kernel_end, supervisor_end = socket.socketpair()
    try:
        pid = os.fork()
    except OSError:
        kernel_end.close()
        supervisor_end.close()
        supervisor = None
    else:
        if pid == 0:  # the supervisor keeps its socket alone: never the host's channel
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            keep = supervisor_end.fileno()
            os.closerange(3, keep)
            os.closerange(keep + 1, 1 << 16)
            try:
                os.set_inheritable(keep, True)
                argv = [*_interpreter(), "-I", "-S", "-B", "-c", _SUPERVISOR, str(keep)]
                os.execv(argv[0], [*argv, _PACKAGE_PARENT])  # noqa: S606  # our own
            except OSError:  # no interpreter to run afresh: this copy of the kernel serves
                from . import procd

                procd.run(supervisor_end)
        supervisor_end.close()
        supervisor = kernel_end
    if int(uid) != os.getuid():
        drop_privileges(int(uid), int(gid), home)
    elif home:
        os.chdir(home)
    return supervisor


def main() -> None:
    channel = Channel.take_stdio()
    supervisor = start_supervisor()
    link_font_list()  # as the session's user: MPLCONFIGDIR must be the user's to write in
    kernel = Kernel(channel)
    await_supervisor(supervisor)  # it starts beside the kernel's own imports
    try:
        kernel.serve(Router(channel, supervisor))
    except BaseException:  # noqa: S110  # the host sees the channel close and reports it
        pass
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
