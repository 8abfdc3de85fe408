"""The computer benchmark's measurements, each against one `cloche serve` child process: new
sessions from warm pools, commands beside cells, pause/resume and fork with a system layer,
and keystrokes echoed through a terminal; each beside its floor, measured in the same run.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

from serving import Serve

TEMPLATE = "debian"
LAYER_MIB = 100
LAYER = "/usr/local/share/layer.bin"  # root writes LAYER_MIB there, in its system layer
BLOCK = 20  # samples of one kind in a row, then the next kind (all see the same machine)
IDLE_S = 0.3  # the session's gap before each "idle" command
IDLE_SHELL = f"command `true` (bash -lc), after {IDLE_S:g} s idle"
IDLE_DIRECT = f"command /bin/true (args), after {IDLE_S:g} s idle"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Samples:
    """Every sample of one run, in ms, by what was measured."""

    ms: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, what: str, value_ms: float) -> None:
        self.ms.setdefault(what, []).append(value_ms)

    def p50(self, what: str) -> float:
        values = self.ms.get(what)
        return statistics.median(values) if values else float("nan")


def timed_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return (time.perf_counter() - started) * 1000, value


class Api:
    """The HTTP calls of this benchmark, each checked (a failure raises with the body)."""

    def __init__(self, server: Serve) -> None:
        self.server = server
        self.http = httpx.Client(base_url=server.target.url, timeout=600)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.http.request(method, path, json=body)
        if response.status_code >= 300:
            raise RuntimeError(f"{method} {path} -> {response.status_code}: {response.text}")
        return response.json() if response.content else None

    def create(self, template: str | None = None) -> str:
        body = {"template": template} if template else {}
        return str(self.call("POST", "/v1/sessions", body)["id"])

    def cell(self, session: str, code: str) -> Any:
        body = self.call("POST", f"/v1/sessions/{session}/execute", {"code": code})
        if body["status"] != "ok":
            raise RuntimeError(f"cell {code!r} failed: {body}")
        return body.get("result_json")

    def command(self, session: str, **body: Any) -> dict[str, Any]:
        done: dict[str, Any] = self.call("POST", f"/v1/sessions/{session}/commands", body)
        if done["exit_code"] != 0:
            raise RuntimeError(f"command {body} failed: {done}")
        return done

    def delete(self, session: str) -> None:
        self.call("DELETE", f"/v1/sessions/{session}")

    def close_all(self) -> None:
        """Close every session left (by a part that failed): the server then stops at once
        instead of pausing them to disk."""
        for session in self.call("GET", "/v1/sessions")["sessions"]:
            try:
                self.delete(session["id"])
            except RuntimeError as exc:
                log(f"closing {session['id']}: {exc}")


# -- setting up ------------------------------------------------------------------------------


def debian_tarball(path: Path) -> Path:
    """`mmdebstrap --variant=minbase --include=python3 bookworm PATH` (a few minutes)."""
    log("making a Debian tarball with mmdebstrap (minbase + python3)")
    subprocess.run(
        ["mmdebstrap", "--variant=minbase", "--include=python3", "bookworm", str(path)],
        check=True,
        capture_output=True,
        timeout=1800,
    )
    return path


def build_template(api: Api, tarball: Path) -> None:
    api.call("POST", "/v1/templates", {"name": TEMPLATE, "from_tar": str(tarball)})
    deadline = time.monotonic() + 1800
    while (info := api.call("GET", f"/v1/templates/{TEMPLATE}"))["state"] == "building":
        if time.monotonic() > deadline:
            raise RuntimeError(f"template {TEMPLATE} still building: {info}")
        time.sleep(0.5)  # polling the build, with a deadline
    if info["state"] != "ready":
        raise RuntimeError(f"template {TEMPLATE} failed: {info['error']}")
    # A template's pool is made at its first session.
    api.delete(api.create(TEMPLATE))


# -- (a) new sessions from warm pools --------------------------------------------------------


def new_sessions(api: Api, samples: Samples, rounds: int, pool_size: int) -> None:
    """`POST /v1/sessions` alone, the pool full and 0.2 s of quiet before each sample, lean
    and template sessions alternately."""
    log(f"new sessions from the pools: {rounds} of each")
    kinds = (("lean", None, "lean"), (f"template {TEMPLATE}", TEMPLATE, f"lean@{TEMPLATE}"))
    for _ in range(rounds):
        for name, template, pool in kinds:
            api.server.wait_pooled(pool, pool_size, timeout_s=600)
            time.sleep(0.2)  # quiet before the sample, as the suite's pool figures
            ms, session = timed_ms(lambda template=template: api.create(template))
            samples.add(f"new session ({name}) from its pool", ms)
            api.delete(session)


# -- (b) a command beside a cell ---------------------------------------------------------------

FLOOR_CODE = """
import os, subprocess, time, statistics
def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
def spawn():
    pid = os.posix_spawn('/bin/true', ['/bin/true'], {})
    os.waitpid(pid, 0)
def run():
    subprocess.run(['/bin/true'])
def shell():
    subprocess.run(['/bin/bash', '-lc', 'true'])
floors = {}
kinds = (
    ('fork+exit (no exec)', fork, ROUNDS),
    ('posix_spawn /bin/true', spawn, ROUNDS),
    ('subprocess /bin/true', run, ROUNDS),
    ('subprocess bash -lc true', shell, max(2, ROUNDS // 4)),
)
for name, fn, n in kinds:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    floors[name] = times
floors
"""


def commands(api: Api, samples: Samples, rounds: int) -> None:
    """A cell (`1+1`), a command line `true` (the template's login shell runs it), `true`
    executed directly (args) and a listing of commands (the same relay to the supervisor,
    no process started), alternately in blocks, in one lean session; and the floors: fork,
    and fork+exec of /bin/true, timed inside the sandbox by a cell."""
    log(f"commands beside cells: {rounds} of each")
    session = api.create()
    kinds: list[tuple[str, Callable[[], Any]]] = [
        ("cell `1+1`", lambda: api.cell(session, "1+1")),
        ("command `true` (bash -lc)", lambda: api.command(session, cmd="true")),
        (
            "command /bin/true, args (no shell)",
            lambda: api.command(session, cmd="/bin/true", args=[]),
        ),
        # The same relay (host -> kernel -> supervisor and back), no process started.
        (
            "list commands (the relay, no process)",
            lambda: api.call("GET", f"/v1/sessions/{session}/commands"),
        ),
        # As an agent runs them, a model's turn apart: the supervisor was idle and forked
        # the next command's leader meanwhile (back to back, each start forks its own).
        (IDLE_SHELL, lambda: api.command(session, cmd="true")),
        (IDLE_DIRECT, lambda: api.command(session, cmd="/bin/true", args=[])),
    ]
    for _, fn in kinds:  # warm: the first of each imports and caches
        fn()
    for _ in range(max(1, rounds // BLOCK)):
        for name, fn in kinds:
            for _ in range(BLOCK):
                if name in (IDLE_SHELL, IDLE_DIRECT):
                    time.sleep(IDLE_S)  # not timed: the gap between an agent's commands
                samples.add(name, timed_ms(fn)[0])
    # Few: forking the kernel's process costs tens of ms to seconds on a busy machine.
    floors = api.cell(session, FLOOR_CODE.replace("ROUNDS", str(max(8, rounds // 10))))
    for name, times in floors.items():
        for value in times:
            samples.add(f"inside, from a cell: {name}", value)
    api.delete(session)


# -- (c) pause/resume and fork with a 100 MiB system layer ------------------------------------


def durability(api: Api, samples: Samples, rounds: int) -> None:
    """Pause, the first cell after it (the resume), and fork of one copy (then its first
    cell) of a lean session with nothing written and of one whose root wrote LAYER_MIB of
    random bytes into its system layer (/usr/local)."""
    log(f"pause/resume and fork: {rounds} rounds of each session")
    plain, heavy = api.create(), api.create()
    api.command(
        heavy,
        cmd=f"head -c {LAYER_MIB}M /dev/urandom > {LAYER}",
        user="root",
        timeout=600,
    )
    for _ in range(rounds):
        for name, session in (("empty layer", plain), (f"{LAYER_MIB} MiB layer", heavy)):
            samples.add(
                f"pause ({name})",
                timed_ms(lambda s=session: api.call("POST", f"/v1/sessions/{s}/pause"))[0],
            )
            samples.add(
                f"resume: first cell after the pause ({name})",
                timed_ms(lambda s=session: api.cell(s, "1+1"))[0],
            )
            ms, forked = timed_ms(
                lambda s=session: api.call("POST", f"/v1/sessions/{s}/fork", {"count": 1})
            )
            samples.add(f"fork of 1 copy ({name})", ms)
            copy = forked["sessions"][0]["id"]
            samples.add(
                f"fork: the copy's first cell ({name})",
                timed_ms(lambda c=copy: api.cell(c, "1+1"))[0],
            )
            size = api.cell(
                copy, f"import os\np = {LAYER!r}\nos.path.exists(p) and os.path.getsize(p)"
            )
            if size != (LAYER_MIB * 1024 * 1024 if session == heavy else False):
                raise RuntimeError(f"the copy's layer holds {size} bytes")
            # A command in the copy too (its supervisor was checkpointed and restored).
            try:
                done = api.call(
                    "POST", f"/v1/sessions/{copy}/commands", {"cmd": "true || false", "timeout": 30}
                )
            except RuntimeError as exc:  # told with the figures, which are measured on
                samples.notes.append(f"a command in a fork's copy ({name}) failed: {exc}")
                api.delete(copy)
                continue
            if done["status"] != "exited":
                samples.notes.append(
                    f"a command in a fork's copy ({name}) did not end: {done['status']}, "
                    f"{done['end_reason']} after {done['duration_ms']:.0f} ms"
                )
            api.delete(copy)
    api.delete(plain)
    api.delete(heavy)


# -- (d) a keystroke echoed through a terminal -------------------------------------------------

PTY_FLOOR_CODE = """
import os, time, tty
master, slave = os.openpty()
times = []
for _ in range(ROUNDS):
    started = time.perf_counter()
    os.write(master, b'x')
    os.read(master, 64)
    times.append((time.perf_counter() - started) * 1000)
os.close(master); os.close(slave)
times
"""


def read_until(terminal: ClientConnection, wanted: bytes, timeout_s: float = 60.0) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout_s
    while wanted not in seen:
        frame = terminal.recv(timeout=max(0.001, deadline - time.monotonic()))
        if isinstance(frame, bytes):
            seen += frame
    return seen


def keystrokes(api: Api, samples: Samples, rounds: int) -> None:
    """A byte typed into a terminal's shell until its echo comes back over the websocket;
    beside it, the same echo of gVisor's pty inside the sandbox (from a cell), and the
    cell's own round trip over HTTP."""
    log(f"terminal keystrokes: {rounds}")
    session = api.create()
    url = api.server.target.url.replace("http://", "ws://") + f"/v1/sessions/{session}/pty"
    with connect(url, open_timeout=120, max_size=None) as terminal:
        terminal.send(b"PS1='ready> '\r")
        read_until(terminal, b"ready> ")
        for i in range(rounds):
            if i % 40 == 39:  # keep the line short: erase it (Ctrl-U)
                terminal.send(b"\x15")
                time.sleep(0.05)  # let the erase's output arrive before the next sample
                while True:
                    try:
                        terminal.recv(timeout=0.05)
                    except TimeoutError:
                        break
            ms, _ = timed_ms(lambda: (terminal.send(b"x"), read_until(terminal, b"x")))
            samples.add("keystroke echo through the terminal (websocket)", ms)
    for _ in range(max(1, rounds // BLOCK)):
        for _ in range(BLOCK):
            samples.add(
                "cell `1+1` (same session, HTTP)", timed_ms(lambda: api.cell(session, "1+1"))[0]
            )
    inside = api.cell(session, PTY_FLOOR_CODE.replace("ROUNDS", str(rounds)))
    for value in inside:
        samples.add("inside, from a cell: a byte echoed by gVisor's pty", value)
    api.delete(session)


def dump(samples: Samples, path: Path) -> None:
    path.write_text(json.dumps({"ms": samples.ms, "notes": samples.notes}, indent=1) + "\n")
