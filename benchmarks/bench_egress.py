"""Egress through a session's door against the same client on the host (issue 25).

    .venv/bin/python benchmarks/bench_egress.py [--requests 300] [--mib 100] [--sessions 50]
        [--seconds 5] [--out DIR]

Needs root and runsc (`./test.sh` installs them). One `cloche serve --egress-policy` child
process, and one upstream child process on 127.0.0.2 (HTTP, and HTTPS with a CA made for the
run, trusted through the policy's upstream_ca_file; bodies sent with sendfile, so that the
upstream, a host process at full CPU weight, takes little of the CPU the sandboxes share),
measured in one run:

1. Request latency: --requests sequential `urllib` GETs of a 2-byte body on new connections
   (one TLS context, made once, as a requests.Session or an httpx.Client keeps it),
   (a) in a session through its door, forwarded (http), tunnelled (https, CONNECT) and
   intercepted (https to a host a secret is for: TLS ends on the host and starts again);
   (b) the same code on the host, straight to the upstream. p50 and p99; added = (a) - (b).
   (c) the floor of any way out, http and https: the client in the session speaking to the
   door's unix socket itself (`http.client`), no relay on the sandbox's loopback.
2. Connections per second: the same loop's rate, in the session (http).
3. Throughput: --mib MiB read by `urllib` in 1 MiB pieces, through the door (each of the three)
   and on the host straight to the upstream, MiB/s (best of 3 each, A B A B); and the floor
   of (1c).
4. Many at once: --sessions sessions each download for --seconds from the same moment
   (http); errors, and each session's MiB/s over the window in which all of them were
   receiving (from the last first byte to the first end): the slowest against the fastest;
   also from the last request on, and the first bytes' delays.

The machine is shared: the load average is printed at the start and the end. Results go to
OUT/egress.json and OUT/egress.md.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cluster import percentile  # noqa: E402
from cleanup import scratch_dir  # noqa: E402
from serving import Serve, serving  # noqa: E402

HOST = "127.0.0.2"

UPSTREAM = textwrap.dedent(
    """
    import http.server, ssl, sys, tempfile, threading
    BIG = b"x" * (1 << 20)
    BLOB = tempfile.TemporaryFile()  # sent with sendfile(2): the upstream costs little CPU
    BLOB.write(BIG * 16)
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_GET(self):
            size = int(self.path.rsplit("/", 1)[1]) if self.path.startswith("/mib/") else 0
            length = size << 20 if size else 2
            self.send_response(200)
            self.send_header("Content-Length", str(length))
            self.send_header("Connection", "close")
            self.end_headers()
            if not size:
                self.wfile.write(b"ok")
            self.wfile.flush()
            left = size << 20
            while left:  # TLS: socket.sendfile reads and sends instead
                sent = self.connection.sendfile(BLOB, 0, min(left, 16 << 20))
                if not sent:
                    break
                left -= sent
            self.close_connection = True
        def log_message(self, *args):
            pass
    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 128  # socketserver's 5 drops a burst of 50 connections' SYNs
        def handle_error(self, request, client_address):
            pass  # a client that stops reading (the many-at-once phase) resets its connection
    plain = Server(("127.0.0.2", 0), Handler)
    secure = Server(("127.0.0.2", 0), Handler)
    intercepted = Server(("127.0.0.2", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(sys.argv[1])
    for server in (secure, intercepted):
        server.socket = context.wrap_socket(server.socket, server_side=True)
    for server in (plain, secure, intercepted):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print(*(s.server_address[1] for s in (plain, secure, intercepted)), flush=True)
    sys.stdin.read()
    """
)

CLIENT = textwrap.dedent(
    """
    import time, urllib.request, ssl
    # One TLS context for every request, as a requests.Session or an httpx.Client keeps:
    # loading a CA bundle of ~150 certificates costs ~20 ms, here and on the host alike.
    opener = urllib.request.build_opener(
        urllib.request.HTTPSHandler(context=ssl.create_default_context())
    )
    def latencies(url, count):
        taken = []
        for _ in range(count):
            started = time.perf_counter()
            with opener.open(url, timeout=60) as answer:
                answer.read()
            taken.append((time.perf_counter() - started) * 1000)
        return taken
    def download(url):
        started = time.perf_counter()
        got = 0
        with opener.open(url, timeout=600) as answer:
            while piece := answer.read(1 << 20):
                got += len(piece)
        return got / (1 << 20) / (time.perf_counter() - started)
    # The floor of any way out of a sandbox: the client itself speaking to the door's unix
    # socket, no relay on the sandbox's loopback (what a client that knew of the door could
    # do; nothing that reads HTTP_PROXY can).
    import http.client, socket
    class DoorHTTP(http.client.HTTPConnection):
        def connect(self):
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect("/run/cloche/door.sock")
    class DoorHTTPS(http.client.HTTPSConnection):
        def connect(self):
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect("/run/cloche/door.sock")
            self._tunnel()
            self.sock = self._context.wrap_socket(self.sock, server_hostname=self._tunnel_host)
    TLS = ssl.create_default_context()
    def straight(url, path):
        scheme, _, hostport = url.partition("://")
        host, port = hostport.rsplit(":", 1)
        if scheme == "http":
            connection = DoorHTTP(host, int(port))
            connection.request("GET", url + path)
        else:
            connection = DoorHTTPS("door", context=TLS)
            connection.set_tunnel(host, int(port))
            connection.request("GET", path)
        answer, got = connection.getresponse(), 0
        while piece := answer.read(1 << 20):
            got += len(piece)
        connection.close()
        return got
    def straight_latencies(url, count):
        taken = []
        for _ in range(count):
            started = time.perf_counter()
            straight(url, "/small")
            taken.append((time.perf_counter() - started) * 1000)
        return taken
    def straight_download(url, mib):
        started = time.perf_counter()
        got = straight(url, f"/mib/{mib}")
        return got / (1 << 20) / (time.perf_counter() - started)
    def trace(url, until):
        # [(unix time, MiB so far)] at the start and after each 256 KiB, until `until`
        points = [(time.time(), 0.0)]
        got = 0
        with opener.open(url, timeout=600) as answer:
            while time.time() < until and (piece := answer.read(1 << 18)):
                got += len(piece)
                points.append((time.time(), got / (1 << 20)))
        points.append((time.time(), got / (1 << 20)))
        return points
    """
)


def make_ca(directory: Path) -> tuple[Path, Path]:
    """A CA file and a server certificate + key for 127.0.0.2 (the tests' helper)."""
    from support import make_test_ca

    ca_file, _ = make_test_ca(directory, HOST)
    return ca_file, directory / "server.pem"


def on_host(code: str, ca_file: Path) -> Any:
    """Run CLIENT + code in a fresh host Python (no proxy variables), its last line JSON."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["SSL_CERT_FILE"] = str(ca_file)  # the sandbox's bundle holds more: see CLIENT
    out = subprocess.run(
        [sys.executable, "-c", CLIENT + code], capture_output=True, text=True, env=env,
        timeout=900, check=True,
    ).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def in_session(http: httpx.Client, session: str, code: str) -> Any:
    answer = http.post(
        f"/v1/sessions/{session}/execute", json={"code": CLIENT + code, "timeout": 900}
    )
    body = answer.json()
    if answer.status_code != 200 or body.get("status") != "ok":
        raise RuntimeError(f"cell failed: {answer.text[:2000]}")
    return json.loads(body["stdout"].strip().splitlines()[-1])


async def many(url: str, sessions: list[str], source: str, seconds: float) -> list[Any]:
    """Each session downloads source for `seconds`, all from one moment on (their cells
    wait for it, so that they start together however the requests were dispatched): its
    trace, or its error (a str)."""
    start_at = time.time() + 3 + 0.1 * len(sessions)
    code = (
        CLIENT + f"import json, time\ntime.sleep(max(0, {start_at} - time.time()))\ntry:\n"
        f"    print(json.dumps(trace({source!r}, {start_at + seconds})))\n"
        "except Exception as exc:\n"
        "    print(json.dumps(repr(exc)))"
    )
    async with httpx.AsyncClient(base_url=url, timeout=1200) as http:

        async def one(session: str) -> Any:
            answer = await http.post(
                f"/v1/sessions/{session}/execute", json={"code": code, "timeout": 1200}
            )
            body = answer.json()
            if answer.status_code != 200 or body.get("status") != "ok":
                return f"cell failed: {answer.text[:500]}"
            return json.loads(body["stdout"].strip().splitlines()[-1])

        return await asyncio.gather(*(one(s) for s in sessions))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"load_start": os.getloadavg()}
    with scratch_dir() as base, tempfile.TemporaryDirectory() as keys:
        ca_file, server_pem = make_ca(Path(keys))
        upstream = subprocess.Popen(
            [sys.executable, "-c", UPSTREAM, str(server_pem)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert upstream.stdout is not None
            plain, secure, intercepted = (int(p) for p in upstream.stdout.readline().split())
            policy = base / "egress.toml"
            policy.write_text(
                f'upstream_ca_file = "{ca_file}"\n[policies.bench]\n'
                f'allow = ["{HOST}:{plain}", "{HOST}:{secure}", "{HOST}:{intercepted}"]\n'
                'secrets = ["BENCH_TOKEN"]\n'
            )
            secrets_file = base / "secrets.toml"  # its host is intercepted (TLS ends on the host)
            secrets_file.write_text(
                f'[secrets.BENCH_TOKEN]\nvalue = "bench"\nhosts = ["{HOST}:{intercepted}"]\n'
            )
            secrets_file.chmod(0o600)
            urls = {
                "http": f"http://{HOST}:{plain}",
                "https": f"https://{HOST}:{secure}",
                "intercepted": f"https://{HOST}:{intercepted}",
            }
            serve_args = ["--pool-size", "4", "--data-pool-size", "0", "--max-sessions", "200",
                          "--cell-timeout", "1200", "--egress-policy", str(policy),
                          "--secrets", str(secrets_file),
                          "--data-dir", str(base / "data")]  # fmt: skip
            with serving(base / "server", *serve_args) as server:
                results.update(measure(server, urls, ca_file, args))
        finally:
            upstream.kill()
            upstream.wait()
    results["load_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "egress.json").write_text(json.dumps(results, indent=1))
    text = report(results, args)
    (args.out / "egress.md").write_text(text)
    print(text)
    return 0


def measure(
    server: Serve, urls: dict[str, str], ca_file: Path, args: argparse.Namespace
) -> dict[str, Any]:
    url = server.target.url
    out: dict[str, Any] = {"latency_ms": {}, "mib_s": {}}
    with httpx.Client(base_url=url, timeout=1200) as http:
        made = http.post("/v1/sessions", json={"egress": "bench"})
        made.raise_for_status()
        session = made.json()["id"]
        for scheme, base_url in urls.items():
            code = f"import json\nprint(json.dumps(latencies('{base_url}/small', 20)))"
            in_session(http, session, code)  # warm-up: imports, first connections
            code = f"import json\nprint(json.dumps(latencies('{base_url}/small', {args.requests})))"
            out["latency_ms"][f"door {scheme}"] = in_session(http, session, code)
            out["latency_ms"][f"host {scheme}"] = on_host(code, ca_file)
            if scheme != "intercepted":
                code = (
                    "import json\nprint(json.dumps("
                    f"straight_latencies('{base_url}', {args.requests})))"
                )
                out["latency_ms"][f"straight {scheme}"] = in_session(http, session, code)
            door = statistics.median(out["latency_ms"][f"door {scheme}"])
            host = statistics.median(out["latency_ms"][f"host {scheme}"])
            print(f"latency {scheme}: door p50 {door:.3f} ms, host {host:.3f} ms", flush=True)
        for scheme, base_url in urls.items():
            code = f"import json\nprint(json.dumps(download('{base_url}/mib/{args.mib}')))"
            straight = (
                f"import json\nprint(json.dumps(straight_download('{base_url}', {args.mib})))"
            )
            door_mib, host_mib, straight_mib = [], [], []
            for _ in range(3):  # A B A B: the machine's load drifts
                door_mib.append(in_session(http, session, code))
                host_mib.append(on_host(code, ca_file))
                if scheme != "intercepted":
                    straight_mib.append(in_session(http, session, straight))
            out["mib_s"][f"door {scheme}"] = door_mib
            out["mib_s"][f"host {scheme}"] = host_mib
            if straight_mib:
                out["mib_s"][f"straight {scheme}"] = straight_mib
            print(f"throughput {scheme}: door {max(door_mib):.0f} MiB/s, host "
                  f"{max(host_mib):.0f} MiB/s", flush=True)  # fmt: skip
        http.delete(f"/v1/sessions/{session}")
        sessions = []
        for _ in range(args.sessions):
            made = http.post("/v1/sessions", json={"egress": "bench"})
            made.raise_for_status()
            sessions.append(made.json()["id"])
            in_session(http, sessions[-1], "print(1)")  # its imports, before the clock
        server.wait_pooled("lean", 4)  # no sandbox starting while they download
        started = time.monotonic()
        source = f"{urls['http']}/mib/100000"  # more than any session reads in --seconds
        out["many"] = asyncio.run(many(url, sessions, source, args.seconds)) if sessions else []
        out["many_s"] = time.monotonic() - started
        for session in sessions:
            http.delete(f"/v1/sessions/{session}")
    return out


def shares(
    traces: list[list[list[float]]], from_first_byte: bool = False
) -> tuple[list[float], float]:
    """Each download's MiB/s over the window in which all of them ran (from the last start,
    or the last first byte, to the first end): a fair share is the same rate for each while
    they share the path. Those that started first and ran alone are not favoured by it."""
    if not traces or (from_first_byte and any(len(trace) < 3 for trace in traces)):
        return [], 0.0
    start = max(trace[1 if from_first_byte else 0][0] for trace in traces)
    end = min(trace[-1][0] for trace in traces)
    if end <= start:
        return [], 0.0  # no moment when all ran: a longer --seconds

    def at(trace: list[list[float]], moment: float) -> float:
        times = [point[0] for point in trace]
        i = max(1, bisect.bisect_left(times, moment))
        (t0, m0), (t1, m1) = trace[i - 1], trace[min(i, len(trace) - 1)]
        return m0 if t1 == t0 else m0 + (m1 - m0) * (moment - t0) / (t1 - t0)

    return [(at(trace, end) - at(trace, start)) / (end - start) for trace in traces], end - start


def spread_of(rates: list[float]) -> float:
    return max(rates) / min(rates) if rates and min(rates) > 0 else float("inf")


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lat = {k: statistics.median(v) for k, v in results["latency_ms"].items()}
    lat99 = {k: percentile(v, 0.99) for k, v in results["latency_ms"].items()}
    best = {k: max(v) for k, v in results["mib_s"].items()}
    many = results["many"]
    errors = [r for r in many if isinstance(r, str)]
    traces = [r for r in many if not isinstance(r, str)]
    rates, window = shares(traces)
    spread = spread_of(rates)
    flowing, flowing_window = shares(traces, from_first_byte=True)
    firsts = sorted(t[1][0] - t[0][0] for t in traces if len(t) > 2)

    def verdict(met: bool) -> str:
        return "met" if met else "missed"

    rows = []
    hows = {"http": "forwarded", "https": "tunnelled (CONNECT)", "intercepted": "intercepted"}
    for scheme, how in hows.items():
        door, host = lat[f"door {scheme}"], lat[f"host {scheme}"]
        target = "≤ 2 ms added" if scheme == "https" else ""
        rows.append((f"request p50 / p99, {how}", f"{door:.3f} / {lat99[f'door {scheme}']:.3f} "
                     f"ms (host: {host:.3f} / {lat99[f'host {scheme}']:.3f}); added "
                     f"{door - host:.3f} ms", target,
                     verdict(door - host <= 2) if target else ""))  # fmt: skip
        if f"straight {scheme}" in lat:
            floor = lat[f"straight {scheme}"]
            rows.append((f"... floor: the client straight to the door, no relay ({scheme})",
                         f"{floor:.3f} ms; added {floor - host:.3f} ms", "", ""))  # fmt: skip
    rows.append(("connections per second (http, one client)",
                 f"{1000 / lat['door http']:.0f}", "", ""))  # fmt: skip
    for scheme in hows:
        ratio = best[f"door {scheme}"] / best[f"host {scheme}"]
        rows.append((f"{args.mib} MiB download, {scheme}: door / host MiB/s",
                     f"{best[f'door {scheme}']:.0f} / {best[f'host {scheme}']:.0f} "
                     f"({ratio:.2f})", "≥ 0.5", verdict(ratio >= 0.5)))  # fmt: skip
        if f"straight {scheme}" in best:
            floor = best[f"straight {scheme}"] / best[f"host {scheme}"]
            rows.append((f"... floor: the client straight to the door, no relay ({scheme})",
                         f"{best[f'straight {scheme}']:.0f} MiB/s ({floor:.2f})", "",
                         ""))  # fmt: skip
    # Downloading at once: from the moment every one had its first byte to the first end.
    # From the last request instead, the figure also measures how fast 50 requests start
    # on two cores (each needs the sandbox's CPU, taken by the downloads already running):
    # given next, with the first bytes' delay.
    rows.append((f"{args.sessions} sessions downloading for {args.seconds:g} s at once",
                 f"{len(errors)} errors; while all {len(flowing)} were receiving "
                 f"({flowing_window:.2f} s): slowest {min(flowing, default=0):.1f}, fastest "
                 f"{max(flowing, default=0):.1f} MiB/s ({spread_of(flowing):.2f}x)",
                 "no error, ≤ 2x",
                 verdict(not errors and bool(flowing) and spread_of(flowing) <= 2)))  # fmt: skip
    rows.append(("... from the last request on (the starts too)",
                 f"({window:.2f} s): slowest {min(rates, default=0):.1f}, fastest "
                 f"{max(rates, default=0):.1f} MiB/s ({spread:.2f}x)", "", ""))  # fmt: skip
    if firsts:
        rows.append(
            (
                "... their first bytes, after the request",
                f"p50 {statistics.median(firsts):.2f} s, last {firsts[-1]:.2f} s",
                "",
                "",
            )
        )
    table = "\n".join("| " + " | ".join(row) + " |" for row in rows)
    load = results["load_start"][0], results["load_end"][0]
    return (
        f"# Egress through a session's door\n\n`.venv/bin/python benchmarks/bench_egress.py "
        f"--requests {args.requests} --mib {args.mib} --sessions {args.sessions} --seconds "
        f"{args.seconds:g}`, one run; load average {load[0]:.1f} at the start, {load[1]:.1f} "
        f"at the end; {os.cpu_count()} cores.\n\n| measure | figure | target | verdict |\n"
        f"|---|---|---|---|\n{table}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
