"""Ports: a server in a session reached through cloche, against the same server on the host
(issue 37).

    .venv/bin/python benchmarks/bench_ports.py [--requests 500] [--mib 100] [--rounds 3]
        [--sessions 50] [--seconds 10] [--out DIR]

Needs root and runsc (`./test.sh` installs them). One `cloche serve` child process; one app
(stdlib HTTP/1.1, keep-alive, bodies sent with sendfile: `ports_parts.APP`), run both in a
session (a background command) and on the host (a child process on 127.0.0.1); one client
program (httpx, in a fresh Python of its own), measured in one run:

1. Request latency: --requests sequential GETs of a 2-byte body on one kept-alive
   connection, (a) through the session's path route, (b) straight to the app on the host;
   p50 and p99, added = (a) - (b). Then a port nobody listens on: the 502's p50.
   The floors, with a raw client (a socket, no HTTP library) against the same raw client
   straight to the app on the host:
   (c) the relay: the sandbox's own relay (`cloche.kernel.ports`), no front end: the bench
       listens on a door of its own in the session's door directory, a relay started in the
       session connects to it, and the raw client speaks the relay's protocol;
   (d) the door alone: the app's own handler in the session serving connections it made to
       another door of the bench's: no relay, no loopback TCP, only the unix socket between
       the host and gVisor;
   (e) in the sandbox: the raw client in the session, to the app on its loopback (both in
       gVisor, over its loopback TCP).
2. Throughput: a --mib MiB download each way above (--rounds rounds, the ways taken in
   turn in each: the machine's load drifts); the median and the best, MiB/s.
3. Many at once: --sessions sessions, each running the app, each downloading through its
   port for --seconds from the same moment (one asyncio client process); errors, and each
   session's MiB/s over the window in which all of them were receiving.

The machine is shared: the load average is printed at the start and the end. Results go to
OUT/ports.json and OUT/ports.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cluster import percentile  # noqa: E402
from bench_egress import shares, spread_of  # noqa: E402
from cleanup import processes_mentioning, scratch_dir  # noqa: E402
from ports_parts import (  # noqa: E402
    APP,
    CLIENT,
    DOOR_APP,
    FLOOR_RELAY,
    IN_SANDBOX,
    MANY,
    raw_download,
    raw_loop,
)
from serving import Serve, serving  # noqa: E402

TOKEN = "bench-ports"  # noqa: S105  # the run's own server's
PORT = 8000  # the app's, in every session
NOBODY = 8999  # a port nobody listens on
NO_LISTENER_REQUESTS = 50
RELAY_SOCKET, DOOR_SOCKET = "bench-relay.sock", "bench-door.sock"  # in the door directory
INSIDE = "/run/cloche"  # the door directory, as the sandbox sees it
# The ways a request goes, as the report names them; "host" and "raw host" are baselines.
WAYS = ("port", "host", "relay", "raw host", "door", "in sandbox")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=500, help="per latency figure")
    parser.add_argument("--mib", type=int, default=100, help="each download's size")
    parser.add_argument("--rounds", type=int, default=3, help="downloads of each way")
    parser.add_argument("--sessions", type=int, default=50, help="downloading at once")
    parser.add_argument("--seconds", type=float, default=10.0, help="their downloads' length")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    for name in ("requests", "mib", "rounds", "sessions"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} is at least 1")
    return args


def client(call: str) -> Any:
    """The client program, in a fresh Python, evaluating call; its JSON answer."""
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, call], capture_output=True, text=True, timeout=3600
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout)


def put(http: httpx.Client, session: str, name: str, source: str) -> None:
    http.put(f"/v1/sessions/{session}/files/{name}", content=source.encode()).raise_for_status()


def background(http: httpx.Client, session: str, line: str) -> None:
    started = http.post(f"/v1/sessions/{session}/commands", json={"cmd": line, "background": True})
    started.raise_for_status()


def start_app(http: httpx.Client, session: str) -> None:
    """The app in a session, listening on PORT (polled: its port in the session's list)."""
    put(http, session, "app.py", APP)
    background(http, session, f"python3 app.py {PORT}")
    deadline = time.monotonic() + 600
    while {"port": PORT} not in http.get(f"/v1/sessions/{session}/ports").json()["ports"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the app never listened in session {session}")
        time.sleep(0.2)


def in_sandbox(http: httpx.Client, session: str, count: int, mib: int) -> dict[str, Any]:
    """The raw client run in the session against the app on its loopback."""
    ran = http.post(
        f"/v1/sessions/{session}/commands",
        json={"cmd": f"python3 in_sandbox.py {PORT} {count} {mib}", "timeout": 1200},
    )
    ran.raise_for_status()
    if ran.json()["exit_code"] != 0:
        raise RuntimeError(f"the client in the session failed: {ran.json()['stderr'][-2000:]}")
    found: dict[str, Any] = json.loads(ran.json()["stdout"])
    return found


class Doors:
    """The bench's own two doors in the session's door directory: one its relay connects to
    (the relay's protocol), one the app's handler connects to (plain HTTP)."""

    def __init__(self, server: Serve, http: httpx.Client, session: str) -> None:
        directory = ports_door(server).parent
        self.paths = [directory / RELAY_SOCKET, directory / DOOR_SOCKET]
        self.relay, self.door = (self._listen(path) for path in self.paths)
        put(http, session, "floor_relay.py", FLOOR_RELAY)
        put(http, session, "door_app.py", DOOR_APP)
        put(http, session, "in_sandbox.py", IN_SANDBOX)
        background(http, session, f"python3 floor_relay.py {INSIDE}/{RELAY_SOCKET}")
        background(http, session, f"python3 door_app.py {INSIDE}/{DOOR_SOCKET}")

    @staticmethod
    def _listen(path: Path) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(path))
        os.chmod(path, 0o666)  # noqa: S103  # the sandbox's user connects
        listener.listen(16)
        listener.settimeout(600)
        return listener

    def through_relay(self) -> tuple[socket.socket, bytes]:
        """A relay connection waiting at the bench's door, and the line that connects it."""
        return self.relay.accept()[0], b"C %d\n" % PORT

    def on_door(self) -> tuple[socket.socket, bytes]:
        """A connection the app in the session made to the bench's other door."""
        return self.door.accept()[0], b""

    def close(self) -> None:
        self.relay.close()
        self.door.close()
        for path in self.paths:
            path.unlink(missing_ok=True)


def cpu_s(pids: list[int]) -> float:
    """CPU time the processes have used (their threads' included), s."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


def ports_door(server: Serve) -> Path:
    """The ports door of the one session whose ports were reached."""
    found = list(server.state.glob("*/sandboxes/*/door/ports.sock"))
    if len(found) != 1:
        raise RuntimeError(f"expected one ports door, found {found}")
    return found[0]


class Cpu:
    """Who used the CPU while something ran: the client (the bench's child processes), the
    server's own process (the front end), the session's sandbox (its runsc processes: the
    pool's idle ones left out), and the host's app."""

    def __init__(self, server: Serve, host_pid: int) -> None:
        self.server = server
        self.host_pid = host_pid
        self.sandbox_id = ports_door(server).parent.parent.name  # .../sandboxes/ID/door
        self.found: dict[str, dict[str, float]] = {}

    def _now(self) -> dict[str, float]:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return {
            "client": children.ru_utime + children.ru_stime,
            "front end": cpu_s([self.server.process.pid]),
            "sandbox": cpu_s(processes_mentioning(self.sandbox_id)),
            "host app": cpu_s([self.host_pid]),
        }

    @contextlib.contextmanager
    def used(self, name: str) -> Iterator[None]:
        """Add the CPU used in the block (s) to name's."""
        before = self._now()
        yield
        after = self._now()
        totals = self.found.setdefault(name, dict.fromkeys(before, 0.0))
        for part, value in after.items():
            totals[part] += value - before[part]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    results: dict[str, Any] = {
        "load_start": os.getloadavg(),
        "args": vars(args) | {"out": ""},
        "command": " ".join(["bench_ports.py", *(sys.argv[1:] if argv is None else argv)]),
        "started_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(f"load average at the start: {results['load_start']}", flush=True)
    with scratch_dir() as base:
        host_app = subprocess.Popen(
            [sys.executable, "-c", APP, "0"], stdout=subprocess.PIPE, text=True
        )
        try:
            assert host_app.stdout is not None
            host_port = int(host_app.stdout.readline())
            serve_args = ["--pool-size", "4", "--data-pool-size", "0",
                          "--max-sessions", str(args.sessions + 20), "--token", TOKEN,
                          "--data-dir", str(base / "data")]  # fmt: skip
            with serving(base / "server", *serve_args) as server:
                results.update(measure(server, host_port, host_app.pid, args))
        finally:
            host_app.kill()
            host_app.wait()
    results["load_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ports.json").write_text(json.dumps(results, indent=1))
    text = report(results)
    (args.out / "ports.md").write_text(text)
    print(text)
    return 0


def measure(
    server: Serve, host_port: int, host_pid: int, args: argparse.Namespace
) -> dict[str, Any]:
    url = server.target.url
    auth = {"Authorization": f"Bearer {TOKEN}"}
    latency: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    with httpx.Client(base_url=url, timeout=1200, headers=auth) as http:
        session = http.post("/v1/sessions").json()["id"]
        start_app(http, session)  # its ports door open: its sandbox is known
        cpu = Cpu(server, host_pid)
        out: dict[str, Any] = {"latency_ms": latency, "mib_s": rates, "cpu_s": cpu.found}
        through = f"{url}/v1/sessions/{session}/ports"
        direct = f"http://127.0.0.1:{host_port}"
        n = args.requests
        client(f"latencies({through + f'/{PORT}/small'!r}, 50, {auth!r})")  # warm-up
        with cpu.used("client start"):  # a fresh Python importing httpx: not the requests'
            client("0")
        with cpu.used("port requests"):
            latency["port"] = client(f"latencies({through + f'/{PORT}/small'!r}, {n}, {auth!r})")
        with cpu.used("host requests"):
            latency["host"] = client(f"latencies({direct + '/small'!r}, {n}, {{}})")
        latency["no listener"] = client(
            f"latencies({through + f'/{NOBODY}/'!r}, {NO_LISTENER_REQUESTS}, {auth!r})"
        )
        doors = Doors(server, http, session)
        try:
            latency["relay"] = raw_loop(*doors.through_relay(), "/small", n)
            latency["raw host"] = raw_loop(_tcp(host_port), b"", "/small", n)
            latency["door"] = raw_loop(*doors.on_door(), "/small", n)
            latency["in sandbox"] = in_sandbox(http, session, n, 0)["latency_ms"]
            for name, value in latency.items():
                print(f"latency {name}: p50 {statistics.median(value):.3f} ms", flush=True)
            mib = args.mib
            port_url, host_url = f"{through}/{PORT}/mib/{mib}", f"{direct}/mib/{mib}"
            for _ in range(args.rounds):  # the ways in turn: the machine's load drifts
                with cpu.used("port downloads"):
                    rates["port"].append(client(f"download({port_url!r}, {auth!r})"))
                with cpu.used("host downloads"):
                    rates["host"].append(client(f"download({host_url!r}, {{}})"))
                rates["relay"].append(raw_download(*doors.through_relay(), mib))
                rates["raw host"].append(raw_download(_tcp(host_port), b"", mib))
                rates["door"].append(raw_download(*doors.on_door(), mib))
                rates["in sandbox"].append(in_sandbox(http, session, 1, mib)["mib_s"])
            for name, values in rates.items():
                print(f"throughput {name}: median {statistics.median(values):.0f} MiB/s")
        finally:
            doors.close()
        http.delete(f"/v1/sessions/{session}")
        out.update(many(server, http, url, auth, args))
    return out


def many(
    server: Serve, http: httpx.Client, url: str, auth: dict[str, str], args: argparse.Namespace
) -> dict[str, Any]:
    """--sessions sessions downloading through their ports from one moment."""
    sessions = []
    for _ in range(args.sessions):
        made = http.post("/v1/sessions")
        made.raise_for_status()
        sessions.append(made.json()["id"])
        start_app(http, sessions[-1])
    server.wait_pooled("lean", 4)  # no sandbox starting while they download
    urls = [f"{url}/v1/sessions/{s}/ports/{PORT}/mib/100000" for s in sessions]
    started = time.monotonic()
    call = json.dumps([urls, args.seconds, auth])
    done = subprocess.run(
        [sys.executable, "-c", MANY, call], capture_output=True, text=True, timeout=3600
    )
    found = json.loads(done.stdout) if done.returncode == 0 else [done.stderr[-500:]]
    elapsed = time.monotonic() - started
    for session in sessions:
        http.delete(f"/v1/sessions/{session}")
    return {"many": found, "many_s": elapsed}


def _tcp(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port))


def verdict(met: bool) -> str:
    return "**met**" if met else "missed"


def report(results: dict[str, Any]) -> str:
    """The table of a run (its figures against the baselines of the same run)."""
    args = results["args"]
    lat = {k: statistics.median(v) for k, v in results["latency_ms"].items()}
    lat99 = {k: percentile(v, 0.99) for k, v in results["latency_ms"].items()}
    med = {k: statistics.median(v) for k, v in results["mib_s"].items()}
    best = {k: max(v) for k, v in results["mib_s"].items()}
    many_runs = results["many"]
    errors = [r for r in many_runs if isinstance(r, str)]
    traces = [r for r in many_runs if not isinstance(r, str)]
    flowing, window = shares(traces, from_first_byte=True)
    from_start, start_window = shares(traces)
    firsts = sorted(t[1][0] - t[0][0] for t in traces if len(t) > 2)
    added = lat["port"] - lat["host"]
    ratio = med["port"] / med["host"]
    spread = spread_of(flowing)
    n, mib, rounds = args["requests"], args["mib"], args["rounds"]

    def floor_latency(way: str, what: str) -> tuple[str, str, str, str]:
        return (f"... floor: {what}", f"{lat[way]:.3f} ms (raw host {lat['raw host']:.3f}); "
                f"added {lat[way] - lat['raw host']:.3f} ms", "", "")  # fmt: skip

    def floor_rate(way: str, what: str) -> tuple[str, str, str, str]:
        return (f"... floor: {what}", f"{med[way]:,.0f} / {med['raw host']:,.0f} "
                f"({med[way] / med['raw host']:.2f}); best {best[way]:,.0f}", "", "")  # fmt: skip

    relay, door = "the relay alone, no front end (raw client)", "the door alone, no relay"
    inside = "client and app both in the sandbox (its loopback)"
    rows = [
        (f"request p50 / p99 through the port (path route, httpx, n={n})",
         f"{lat['port']:.3f} / {lat99['port']:.3f} ms (host {lat['host']:.3f} / "
         f"{lat99['host']:.3f}); added {added:.3f} ms", "≤ 1 ms added", verdict(added <= 1)),
        floor_latency("relay", relay),
        floor_latency("door", door),
        floor_latency("in sandbox", inside),
        (f"a port nobody listens on: 502 p50 / p99 (n={NO_LISTENER_REQUESTS})",
         f"{lat['no listener']:.3f} / {lat99['no listener']:.3f} ms", "≤ 1 s",
         verdict(lat99["no listener"] <= 1000)),
        (f"{mib} MiB download: port / host MiB/s (median of {rounds})",
         f"{med['port']:,.0f} / {med['host']:,.0f} ({ratio:.2f}); best {best['port']:,.0f} / "
         f"{best['host']:,.0f}", "≥ 0.5", verdict(ratio >= 0.5)),
        floor_rate("relay", relay),
        floor_rate("door", door),
        floor_rate("in sandbox", inside),
        (f"{args['sessions']} sessions downloading through their ports for "
         f"{args['seconds']:g} s",
         f"{len(errors)} errors; while all {len(flowing)} were receiving ({window:.2f} s): "
         f"slowest {min(flowing, default=0):.1f}, fastest {max(flowing, default=0):.1f} "
         f"MiB/s ({spread:.2f}x)", "no error, ≤ 2x",
         verdict(not errors and len(flowing) == args["sessions"] and spread <= 2)),
        ("... from the last request on",
         f"slowest {min(from_start, default=0):.1f}, fastest "
         f"{max(from_start, default=0):.1f} MiB/s ({spread_of(from_start):.2f}x, "
         f"{start_window:.2f} s)", "", ""),
        ("... their first bytes, after the request",
         f"p50 {statistics.median(firsts) if firsts else 0:.2f} s, last "
         f"{firsts[-1] if firsts else 0:.2f} s", "", ""),
    ]  # fmt: skip
    load = results["load_start"], results["load_end"]
    lines = [
        "# Ports through cloche against the same server on the host",
        "",
        f"`{results['command']}`, {results['started_utc']}: load average "
        f"{load[0][0]:.1f} at the start, {load[1][0]:.1f} at the end "
        f"({os.cpu_count()} cores).",
        "",
        "| measure | figure | target | verdict |",
        "|---|---|---|---|",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows),
    ]
    lines += ["", *cpu_lines(results)]
    if errors:
        lines += ["", "Errors:", *(f"- {e}" for e in errors[:10])]
    return "\n".join(lines) + "\n"


def cpu_lines(results: dict[str, Any]) -> list[str]:
    """Who used the CPU for the port's requests and downloads, and for the host's (the
    client's start, a fresh Python importing httpx, taken out)."""
    cpu = results["cpu_s"]
    args = results["args"]
    start = cpu["client start"]["client"]

    def parts(name: str, each: float, calls: int, unit: str) -> str:
        used = dict(cpu[name])
        used["client"] = max(0.0, used["client"] - start * calls)
        shown = [f"{part} {value * each:.2f}" for part, value in used.items() if value > 0]
        return f"{', '.join(shown)} {unit} (sum {sum(used.values()) * each:.2f})"

    per_request = 1000 / (args["requests"] + 1)
    per_gib = 1024 / (args["mib"] * args["rounds"])
    return [
        "CPU used (the machine has 2 cores: what the path through the port uses is taken "
        "from the client and the app; sandbox: the session's, idle during the host's "
        "figures):",
        "",
        f"- per request through the port: {parts('port requests', per_request, 1, 'ms')}",
        f"- per request to the host's app: {parts('host requests', per_request, 1, 'ms')}",
        f"- per GiB through the port: {parts('port downloads', per_gib, args['rounds'], 's')}",
        f"- per GiB from the host's app: {parts('host downloads', per_gib, args['rounds'], 's')}",
    ]


if __name__ == "__main__":
    sys.exit(main())
