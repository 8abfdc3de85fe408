"""Ports: a server in a session reached through cloche, against the same server on the host
(issue 37).

    .venv/bin/python benchmarks/bench_ports.py [--requests 500] [--mib 100] [--sessions 50]
        [--seconds 5] [--out DIR]

Needs root and runsc (`./test.sh` installs them). One `cloche serve` child process; one app
(stdlib HTTP/1.1, keep-alive, bodies sent with sendfile), run both in a session (a
background command) and on the host (a child process on 127.0.0.1); one client program
(httpx, in a child process of its own), measured in one run:

1. Request latency: --requests sequential GETs of a 2-byte body on one kept-alive
   connection, (a) through the session's path route, (b) straight to the app on the host.
   p50 and p99; added = (a) - (b).
   (c) The floor: the same requests through the sandbox's own relay (`cloche.kernel.ports`)
   with no front end: the bench listens on a door of its own in the session's door
   directory, a relay started in the session connects to it, and a raw HTTP client speaks
   the relay's protocol; against the same raw client straight to the app on the host.
2. Throughput: a --mib MiB download, through the port and straight to the app on the host
   (best of 3 each, A B A B), MiB/s; and the floor of (1c).
3. Many at once: --sessions sessions, each running the app, each downloading through its
   port for --seconds from the same moment (one asyncio client process); errors, and each
   session's MiB/s over the window in which all of them were receiving.

The machine is shared: the load average is printed at the start and the end. Results go to
OUT/ports.json and OUT/ports.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cluster import percentile  # noqa: E402
from bench_egress import shares, spread_of  # noqa: E402
from cleanup import scratch_dir  # noqa: E402
from serving import Serve, serving  # noqa: E402

TOKEN = "bench-ports"  # noqa: S105  # the run's own server's
PORT = 8000  # the app's, in every session
APP = textwrap.dedent(
    """
    import http.server, socket, sys, tempfile
    BLOB = tempfile.TemporaryFile()  # sent with sendfile(2)
    BLOB.write(b"x" * (16 << 20))
    BLOB.flush()
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_GET(self):
            mib = int(self.path.rsplit("/", 1)[1]) if self.path.startswith("/mib/") else 0
            self.send_response(200)
            self.send_header("Content-Length", str(mib << 20 if mib else 2))
            self.end_headers()
            if not mib:
                self.wfile.write(b"ok")
                return
            self.wfile.flush()
            left = mib << 20
            while left:
                sent = self.connection.sendfile(BLOB, 0, min(left, 16 << 20))
                if not sent:
                    break
                left -= sent
        def log_message(self, *args):
            pass
    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 128
        allow_reuse_address = True
        def handle_error(self, request, client_address):
            pass  # a client that stops reading (the many-at-once phase) resets its connection
    server = Server(("127.0.0.1", int(sys.argv[1])), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()
    """
)
# A relay of the sandbox's own code, driven by hand: it connects to the bench's door.
FLOOR_RELAY = textwrap.dedent(
    """
    import json, socket, struct, sys, threading
    sys.path.insert(0, "/opt/cloche")
    from cloche.kernel import ports
    ours, theirs = socket.socketpair()
    threading.Thread(target=ports.Relay(theirs).run, daemon=True).start()
    body = json.dumps({"op": "ports.open", "rid": 1, "door": sys.argv[1], "spare": 2}).encode()
    ours.sendall(struct.pack(">I", len(body)) + body)
    print(ours.recv(65536)[4:].decode(), flush=True)
    threading.Event().wait()
    """
)
CLIENT = textwrap.dedent(
    """
    import json, sys, time
    import httpx
    def latencies(url, count, headers):
        taken = []
        with httpx.Client(headers=headers, timeout=600) as client:
            client.get(url).read()  # the connection, kept alive from now on
            for _ in range(count):
                started = time.perf_counter()
                client.get(url).read()
                taken.append((time.perf_counter() - started) * 1000)
        return taken
    def download(url, headers):
        with httpx.Client(headers=headers, timeout=600) as client:
            started = time.perf_counter()
            size = 0
            with client.stream("GET", url) as answer:
                for piece in answer.iter_raw(1 << 20):
                    size += len(piece)
            return size / (1 << 20) / (time.perf_counter() - started)
    print(json.dumps(eval(sys.argv[1])))
    """
)
MANY = textwrap.dedent(
    """
    import asyncio, json, sys, time
    import httpx
    async def one(client, url, until):
        trace = [[time.monotonic(), 0.0]]
        try:
            async with client.stream("GET", url) as answer:
                answer.raise_for_status()
                got = 0
                async for piece in answer.aiter_raw(1 << 20):
                    got += len(piece)
                    trace.append([time.monotonic(), got / (1 << 20)])
                    if time.monotonic() >= until:
                        break
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return trace
    async def main(urls, seconds, headers):
        limits = httpx.Limits(max_connections=len(urls) + 10)
        async with httpx.AsyncClient(headers=headers, timeout=600, limits=limits) as client:
            until = time.monotonic() + seconds
            return await asyncio.gather(*(one(client, u, until) for u in urls))
    urls, seconds, headers = json.loads(sys.argv[1])
    print(json.dumps(asyncio.run(main(urls, seconds, headers))))
    """
)


def client(call: str) -> Any:
    """The client program, in a fresh Python, evaluating call; its JSON answer."""
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, call], capture_output=True, text=True, timeout=3600
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout)


def start_app(http: httpx.Client, session: str) -> None:
    """The app in a session, listening on PORT (polled: its port in the session's list)."""
    http.put(f"/v1/sessions/{session}/files/app.py", content=APP.encode()).raise_for_status()
    started = http.post(
        f"/v1/sessions/{session}/commands",
        json={"cmd": f"python3 app.py {PORT}", "background": True},
    )
    started.raise_for_status()
    deadline = time.monotonic() + 600
    while {"port": PORT} not in http.get(f"/v1/sessions/{session}/ports").json()["ports"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the app never listened in session {session}")
        time.sleep(0.2)


def door_dir(server: Serve) -> Path:
    """The door directory of the one session whose ports were reached (it has ports.sock)."""
    found = list(server.state.glob("*/sandboxes/*/door/ports.sock"))
    if len(found) != 1:
        raise RuntimeError(f"expected one ports door, found {found}")
    return found[0].parent


def floor_door(server: Serve, http: httpx.Client, session: str) -> tuple[Path, Any]:
    """A door of the bench's own in the session's door directory, and a relay of the
    sandbox's own code started in the session that keeps connections waiting at it."""
    import socket

    path = door_dir(server) / "bench.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    os.chmod(path, 0o666)  # noqa: S103  # the sandbox's user connects
    listener.listen(16)
    http.put(f"/v1/sessions/{session}/files/floor.py", content=FLOOR_RELAY.encode())
    http.post(
        f"/v1/sessions/{session}/commands",
        json={"cmd": "python3 floor.py /run/cloche/bench.sock", "background": True},
    ).raise_for_status()
    return path, listener


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"load_start": os.getloadavg(), "args": vars(args) | {"out": ""}}
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
                results.update(measure(server, host_port, args))
        finally:
            host_app.kill()
            host_app.wait()
    results["load_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ports.json").write_text(json.dumps(results, indent=1))
    text = report(results, args)
    (args.out / "ports.md").write_text(text)
    print(text)
    return 0


def measure(server: Serve, host_port: int, args: argparse.Namespace) -> dict[str, Any]:
    url = server.target.url
    auth = {"Authorization": f"Bearer {TOKEN}"}
    out: dict[str, Any] = {"latency_ms": {}, "mib_s": {}}
    with httpx.Client(base_url=url, timeout=1200, headers=auth) as http:
        session = http.post("/v1/sessions").json()["id"]
        start_app(http, session)
        through = f"{url}/v1/sessions/{session}/ports/{PORT}"
        direct = f"http://127.0.0.1:{host_port}"
        n = args.requests
        client(f"latencies({through + '/small'!r}, 50, {auth!r})")  # warm-up
        out["latency_ms"]["port"] = client(f"latencies({through + '/small'!r}, {n}, {auth!r})")
        out["latency_ms"]["host"] = client(f"latencies({direct + '/small'!r}, {n}, {{}})")
        path, listener = floor_door(server, http, session)
        with listener:
            out["latency_ms"]["floor"], out["latency_ms"]["floor host"] = floor_latencies(
                listener, host_port, n
            )
            for name, value in out["latency_ms"].items():
                print(f"latency {name}: p50 {statistics.median(value):.3f} ms", flush=True)
            mib = args.mib
            for _ in range(3):  # A B A B: the machine's load drifts
                for name, target, headers in (
                    ("port", f"{through}/mib/{mib}", auth),
                    ("host", f"{direct}/mib/{mib}", {}),
                ):
                    rate = client(f"download({target!r}, {headers!r})")
                    out["mib_s"].setdefault(name, []).append(rate)
                floor, floor_host = floor_download(listener, host_port, mib)
                out["mib_s"].setdefault("floor", []).append(floor)
                out["mib_s"].setdefault("floor host", []).append(floor_host)
            for name, rates in out["mib_s"].items():
                print(f"throughput {name}: best {max(rates):.0f} MiB/s", flush=True)
        path.unlink(missing_ok=True)
        http.delete(f"/v1/sessions/{session}")
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
        out["many"] = json.loads(done.stdout) if done.returncode == 0 else [done.stderr[-500:]]
        out["many_s"] = time.monotonic() - started
        for session in sessions:
            http.delete(f"/v1/sessions/{session}")
    return out


def _take(listener: Any) -> Any:
    """A relay connection waiting at the bench's door."""
    listener.settimeout(600)
    sock, _ = listener.accept()
    return sock


def floor_latencies(listener: Any, host_port: int, count: int) -> tuple[list[float], list[float]]:
    """The raw client through the relay (no front end), and straight to the host's app."""
    sock = _take(listener)
    floor = _raw_loop(sock, b"C %d\n" % PORT, "/small", count)
    direct = _raw_loop(_tcp(host_port), b"", "/small", count)
    return floor, direct


def floor_download(listener: Any, host_port: int, mib: int) -> tuple[float, float]:
    rates = []
    for sock, first in ((_take(listener), b"C %d\n" % PORT), (_tcp(host_port), b"")):
        started = time.perf_counter()
        _raw_loop(sock, first, f"/mib/{mib}", 0)
        rates.append(mib / (time.perf_counter() - started))
    return rates[0], rates[1]


def _tcp(port: int) -> Any:
    import socket

    return socket.create_connection(("127.0.0.1", port))


def _raw_loop(sock: Any, first: bytes, path: str, count: int) -> list[float]:
    """GETs of path on one connection (the first alone when count is 0); their times, ms."""
    sock.settimeout(600)
    if first:
        sock.sendall(first)
        assert sock.recv(2) == b"K\n"
    reader = sock.makefile("rb", buffering=1 << 20)
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()

    def get() -> None:
        sock.sendall(request)
        length = 0
        while (line := reader.readline()) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        left = length
        while left:
            got = reader.read1(min(left, 1 << 20))
            if not got:
                raise RuntimeError("the connection ended early")
            left -= len(got)

    get()
    taken = []
    for _ in range(count):
        started = time.perf_counter()
        get()
        taken.append((time.perf_counter() - started) * 1000)
    sock.close()
    return taken


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lat = {k: statistics.median(v) for k, v in results["latency_ms"].items()}
    lat99 = {k: percentile(v, 0.99) for k, v in results["latency_ms"].items()}
    best = {k: max(v) for k, v in results["mib_s"].items()}
    many = results["many"]
    errors = [r for r in many if isinstance(r, str)]
    traces = [r for r in many if not isinstance(r, str)]
    flowing, window = shares(traces, from_first_byte=True)
    from_start, start_window = shares(traces)
    firsts = sorted(t[1][0] - t[0][0] for t in traces if len(t) > 2)

    def verdict(met: bool) -> str:
        return "**met**" if met else "missed"

    added = lat["port"] - lat["host"]
    floor_added = lat["floor"] - lat["floor host"]
    ratio = best["port"] / best["host"]
    floor_ratio = best["floor"] / best["floor host"]
    spread = spread_of(flowing)
    rows = [
        ("request p50 / p99 through the port (path route)",
         f"{lat['port']:.3f} / {lat99['port']:.3f} ms (host: {lat['host']:.3f} / "
         f"{lat99['host']:.3f}); added {added:.3f} ms", "≤ 1 ms added", verdict(added <= 1)),
        ("... floor: the sandbox's relay, no front end (raw client)",
         f"{lat['floor']:.3f} ms (host: {lat['floor host']:.3f}); added {floor_added:.3f} ms",
         "", ""),
        (f"{args.mib} MiB download: port / host MiB/s (best of 3)",
         f"{best['port']:.0f} / {best['host']:.0f} ({ratio:.2f})", "≥ 0.5",
         verdict(ratio >= 0.5)),
        ("... floor: the sandbox's relay, no front end (raw client)",
         f"{best['floor']:.0f} / {best['floor host']:.0f} ({floor_ratio:.2f})", "", ""),
        (f"{args.sessions} sessions downloading through their ports for {args.seconds:g} s",
         f"{len(errors)} errors; while all {len(flowing)} were receiving ({window:.2f} s): "
         f"slowest {min(flowing, default=0):.1f}, fastest {max(flowing, default=0):.1f} "
         f"MiB/s ({spread:.2f}x)", "no error, ≤ 2x",
         verdict(not errors and len(flowing) == args.sessions and spread <= 2)),
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
        f"`{' '.join(['bench_ports.py', *sys.argv[1:]])}`: load average "
        f"{load[0][0]:.1f} at the start, {load[1][0]:.1f} at the end "
        f"({os.cpu_count()} cores).",
        "",
        "| measure | figure | target | verdict |",
        "|---|---|---|---|",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows),
    ]
    if errors:
        lines += ["", "Errors:", *(f"- {e}" for e in errors[:10])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
