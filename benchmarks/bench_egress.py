"""Egress through a session's door against the same client on the host (issue 25).

    .venv/bin/python benchmarks/bench_egress.py [--requests 300] [--mib 100] [--sessions 50]
        [--each-mib 10] [--out DIR]

Needs root and runsc (`./test.sh` installs them). One `cloche serve --egress-policy` child
process, and one upstream child process on 127.0.0.2 (HTTP, and HTTPS with a CA made for the
run, trusted through the policy's upstream_ca_file), measured in one run:

1. Request latency: --requests sequential `urllib` GETs of a 2-byte body on new connections
   (one TLS context, made once, as a requests.Session or an httpx.Client keeps it),
   (a) in a session through its door, forwarded (http) and tunnelled (https, CONNECT);
   (b) the same code on the host, straight to the upstream. p50 and p99; added = (a) - (b).
2. Connections per second: the same loop's rate, in the session (http).
3. Throughput: --mib MiB read by `urllib` in 1 MiB pieces, through the door (http and https)
   and on the host straight to the upstream, MiB/s (best of 3 each, A B A B).
4. Many at once: --sessions sessions each download --each-mib MiB at the same moment
   (http); errors, and each session's MiB/s: the slowest against the fastest.

The machine is shared: the load average is printed at the start and the end. Results go to
OUT/egress.json and OUT/egress.md.
"""

from __future__ import annotations

import argparse
import asyncio
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
from bench_core import scratch_dir  # noqa: E402
from suite import serving  # noqa: E402

HOST = "127.0.0.2"

UPSTREAM = textwrap.dedent(
    """
    import http.server, ssl, sys, threading
    BIG = b"x" * (1 << 20)
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
            for _ in range(size):
                self.wfile.write(BIG)
            self.close_connection = True
        def log_message(self, *args):
            pass
    plain = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Handler)
    secure = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(sys.argv[1])
    secure.socket = context.wrap_socket(secure.socket, server_side=True)
    for server in (plain, secure):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print(plain.server_address[1], secure.server_address[1], flush=True)
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


async def many(url: str, sessions: list[str], source: str) -> list[Any]:
    """Each session downloads source, all from one moment on (their cells wait for it, so
    that they start together however the requests were dispatched): its MiB/s, or its
    error (a str)."""
    start_at = time.time() + 3 + 0.1 * len(sessions)
    code = (
        CLIENT + f"import json, time\ntime.sleep(max(0, {start_at} - time.time()))\ntry:\n"
        f"    print(json.dumps(download({source!r})))\nexcept Exception as exc:\n"
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
    parser.add_argument("--each-mib", type=int, default=10)
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
            plain, secure = (int(p) for p in upstream.stdout.readline().split())
            policy = base / "egress.toml"
            policy.write_text(
                f'upstream_ca_file = "{ca_file}"\n[policies.bench]\n'
                f'allow = ["{HOST}:{plain}", "{HOST}:{secure}"]\n'
            )
            urls = {"http": f"http://{HOST}:{plain}", "https": f"https://{HOST}:{secure}"}
            serve_args = ["--pool-size", "4", "--data-pool-size", "0", "--max-sessions", "200",
                          "--cell-timeout", "1200", "--egress-policy", str(policy),
                          "--data-dir", str(base / "data")]  # fmt: skip
            with serving(base / "server", *serve_args) as server:
                results.update(measure(server.target.url, urls, ca_file, args))
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
    url: str, urls: dict[str, str], ca_file: Path, args: argparse.Namespace
) -> dict[str, Any]:
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
            door = statistics.median(out["latency_ms"][f"door {scheme}"])
            host = statistics.median(out["latency_ms"][f"host {scheme}"])
            print(f"latency {scheme}: door p50 {door:.3f} ms, host {host:.3f} ms", flush=True)
        for scheme, base_url in urls.items():
            code = f"import json\nprint(json.dumps(download('{base_url}/mib/{args.mib}')))"
            door_mib, host_mib = [], []
            for _ in range(3):  # A B A B: the machine's load drifts
                door_mib.append(in_session(http, session, code))
                host_mib.append(on_host(code, ca_file))
            out["mib_s"][f"door {scheme}"] = door_mib
            out["mib_s"][f"host {scheme}"] = host_mib
            print(f"throughput {scheme}: door {max(door_mib):.0f} MiB/s, host "
                  f"{max(host_mib):.0f} MiB/s", flush=True)  # fmt: skip
        http.delete(f"/v1/sessions/{session}")
        sessions = []
        for _ in range(args.sessions):
            made = http.post("/v1/sessions", json={"egress": "bench"})
            made.raise_for_status()
            sessions.append(made.json()["id"])
        started = time.monotonic()
        source = f"{urls['http']}/mib/{args.each_mib}"
        out["many"] = asyncio.run(many(url, sessions, source)) if sessions else []
        out["many_s"] = time.monotonic() - started
        for session in sessions:
            http.delete(f"/v1/sessions/{session}")
    return out


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lat = {k: statistics.median(v) for k, v in results["latency_ms"].items()}
    lat99 = {k: percentile(v, 0.99) for k, v in results["latency_ms"].items()}
    best = {k: max(v) for k, v in results["mib_s"].items()}
    many = results["many"]
    errors = [r for r in many if isinstance(r, str)]
    rates = [r for r in many if not isinstance(r, str)]
    spread = max(rates) / min(rates) if rates else float("inf")

    def verdict(met: bool) -> str:
        return "met" if met else "missed"

    rows = []
    for scheme in ("http", "https"):
        door, host = lat[f"door {scheme}"], lat[f"host {scheme}"]
        how = "forwarded" if scheme == "http" else "tunnelled (CONNECT)"
        target = "≤ 2 ms added" if scheme == "https" else ""
        rows.append((f"request p50 / p99, {how}", f"{door:.3f} / {lat99[f'door {scheme}']:.3f} "
                     f"ms (host: {host:.3f} / {lat99[f'host {scheme}']:.3f}); added "
                     f"{door - host:.3f} ms", target,
                     verdict(door - host <= 2) if target else ""))  # fmt: skip
    rows.append(("connections per second (http, one client)",
                 f"{1000 / lat['door http']:.0f}", "", ""))  # fmt: skip
    for scheme in ("http", "https"):
        ratio = best[f"door {scheme}"] / best[f"host {scheme}"]
        rows.append((f"{args.mib} MiB download, {scheme}: door / host MiB/s",
                     f"{best[f'door {scheme}']:.0f} / {best[f'host {scheme}']:.0f} "
                     f"({ratio:.2f})", "≥ 0.5", verdict(ratio >= 0.5)))  # fmt: skip
    rows.append((f"{args.sessions} sessions × {args.each_mib} MiB at once",
                 f"{len(errors)} errors; slowest {min(rates, default=0):.1f}, fastest "
                 f"{max(rates, default=0):.1f} MiB/s ({spread:.2f}x); {results['many_s']:.1f} s",
                 "no error, ≤ 2x", verdict(not errors and spread <= 2)))  # fmt: skip
    table = "\n".join("| " + " | ".join(row) + " |" for row in rows)
    load = results["load_start"][0], results["load_end"][0]
    return (
        f"# Egress through a session's door\n\n`.venv/bin/python benchmarks/bench_egress.py "
        f"--requests {args.requests} --mib {args.mib} --sessions {args.sessions} --each-mib "
        f"{args.each_mib}`, one run; load average {load[0]:.1f} at the start, {load[1]:.1f} "
        f"at the end; {os.cpu_count()} cores.\n\n| measure | figure | target | verdict |\n"
        f"|---|---|---|---|\n{table}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
