"""Helpers for tests: real servers (gVisor backend) run in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloche.client.tcp import TCPClient
from cloche.config import Limits, ServerConfig
from cloche.server.app import Server

REPO = Path(__file__).resolve().parent.parent
RUNTIME_DIR = REPO / ".runtime" / "site-packages"


# CPU time of LOOP on this project's machines, with room to spare (~0.015 s measured).
REFERENCE_LOOP_CPU_S = 0.03
LOOP = 200_000


@functools.cache
def slowness() -> float:
    """How many times slower than this project's machines this one runs Python on the CPU
    now: 1 there, busy or not (CPU time, not wall time); 10-100 in a VM whose CPU is
    emulated, where a sandbox's idle ticks and a trivial cell cost as much more. The time
    scales of the tests that depend on speed (slices, spins, waits, and the servers'
    sandbox start timeout, `--sandbox-start-timeout`) are multiplied by it.
    CLOCHE_TEST_SLOWNESS sets a floor under it: under an emulated CPU, gVisor's own work
    (forks, page faults, signals) slows down far more than a Python loop does."""
    floor = float(os.environ.get("CLOCHE_TEST_SLOWNESS") or 1.0)
    best = float("inf")
    for _ in range(3):
        began, total = time.process_time(), 0
        for i in range(LOOP):
            total += i
        best = min(best, time.process_time() - began)
    return max(1.0, floor, best / REFERENCE_LOOP_CPU_S)


# A slice no cell outlasts (--cell-slice): no cell goes behind the host's processes (the
# top-level cloche-behind/ group), where a busy test machine leaves it no CPU at all: a lean
# session's first plot beside three CPU hogs timed out at 300 s behind the host, and took
# 1.6-2.3 s level with it. For tests about what cells produce, not about where they run.
NEVER_BEHIND_SLICE_S = 1e9

# What `%time` and `%timeit` print (cloche.kernel.timing, in IPython's words): a duration as
# format_time writes it (%.3g: an exponent for the tiny stdev of equal runs).
TIME = r"\d+(\.\d+)?(e[+-]\d+)? (s|ms|μs|ns)"


def timeit_printed(runs: str, loops: str) -> str:
    """A pattern of all that `%timeit` prints: its summary, after IPython's warning when a
    run took over 4x the fastest and before the compile time when over 0.1 s (lines that a
    busy machine brings on, each in its exact words)."""
    slowest = (
        r"(The slowest run took \d+\.\d\d times longer than the fastest\. "
        r"This could mean that an intermediate result is being cached\.\n)?"
    )
    summary = rf"{TIME} ± {TIME} per loop \(mean ± std\. dev\. of {runs}, {loops} each\)\n"
    return rf"{slowest}{summary}(Compiler time: \d+\.\d\d s\n)?"


def gvisor_usable() -> bool:
    return os.geteuid() == 0 and shutil.which("runsc") is not None


def require_gvisor() -> None:
    """Integration tests prove things only against real runsc: never fall back quietly."""
    if not gvisor_usable():
        if os.environ.get("CLOCHE_TEST_ALLOW_NO_GVISOR") == "1":
            pytest.skip("runsc not usable here (CLOCHE_TEST_ALLOW_NO_GVISOR=1)")
        pytest.fail("these tests need runsc and root: run ./test.sh, which installs runsc")


def require_cluster() -> None:
    """Cluster tests need runsc and Ray (./test.sh installs both): never skipped quietly."""
    require_gvisor()
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.fail("cluster tests need Ray: run ./test.sh, which installs cloche[cluster]")


@contextlib.contextmanager
def cluster_server(config: ServerConfig) -> Iterator[ServerThread]:
    """A ServerThread over a local Ray cluster (config.cluster = "local:N"); once it has
    stopped, nothing of the cluster is left: Ray's temp dir, the nodes' state dirs."""
    require_cluster()
    with ServerThread(config) as running:
        ray_temp = running.server.manager.engine.temp_dir  # type: ignore[union-attr]
        yield running
    assert ray_temp is not None
    _ended_ray_temps.append(ray_temp)
    # Nor has Ray made an earlier cluster's dir again meanwhile (it did, while a later ran).
    assert [temp for temp in _ended_ray_temps if Path(temp).exists()] == []
    assert list(config.state_dir.glob("node-*")) == []


_ended_ray_temps: list[str] = []  # of this test process's local clusters


class ServerThread:
    """A real cloche Server on its own event loop in a thread, on free ports."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.server = Server(config)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self.call(self.server.start(), timeout_s=600)
        self.call(self.server.manager.wait_ready("lean", 600 * slowness()), timeout_s=600)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            # Its sessions are paused to disk first: a wedged sandbox's checkpoint may take
            # runsc's whole 120 s before the session is closed instead; leaving earlier
            # would leave that sandbox running.
            self.call(self.server.stop(), timeout_s=400)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
            self.loop.close()

    def call(self, coro: object, timeout_s: float = 120.0) -> object:
        """Run coro on the server's loop; timeout_s as on this project's machines (scaled by
        slowness() here)."""
        future: Future[object] = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout_s * slowness())
        except TimeoutError:
            told = asyncio.run_coroutine_threadsafe(_print_tasks(), self.loop)
            with contextlib.suppress(Exception):  # a loop that never comes back tells nothing
                told.result(10)
            raise

    @property
    def tcp_port(self) -> int:
        assert self.server.tcp.port is not None
        return self.server.tcp.port

    @property
    def http_port(self) -> int:
        assert self.server.http is not None
        return self.server.http.port

    def client(self) -> TCPClient:
        return TCPClient("127.0.0.1", self.tcp_port)


async def _print_tasks() -> None:
    """Every task of the running loop and where it waits, on stderr (for a call that took
    too long: the test's report then says what the server was doing)."""
    for task in asyncio.all_tasks() - {asyncio.current_task()}:
        print(f"-- {task.get_name()}: {task.get_coro()!r}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)


def adopt(module_path: str, namespace: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
    """Run another module's tests here too, with the fixtures defined here after this call
    (a cluster server instead of one machine, say): its test functions and fixtures are
    copied into namespace, except the tests named in skip."""
    import importlib.util

    path = Path(__file__).parent / module_path
    name = "adopted_" + module_path.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for key, value in vars(module).items():
        if key.startswith("__") or key in skip or key in namespace:
            continue
        namespace[key] = value


def sse_events(response: httpx.Response) -> Iterator[tuple[str, Any]]:
    """Server-Sent Events as (event, decoded data), as they arrive."""
    name: str | None = None
    data: list[str] = []
    for line in response.iter_lines():
        if line == "":
            if name is not None:
                yield name, json.loads("\n".join(data))
            name, data = None, []
        elif line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").strip())


def fresh_data_dir(state_dir: Path) -> Path:
    """A data directory of a server's own, beside (never inside) the state directory."""
    import tempfile

    base = state_dir.parent / "data"
    base.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(dir=base))


# --sandbox-start-timeout's default, which the tests' servers scale by slowness(): under an
# emulated CPU sharing a busy host, five sandboxes started at once took over a minute.
SANDBOX_START_TIMEOUT_S = 60.0


def make_config(state_dir: Path, **overrides: object) -> ServerConfig:
    limits = overrides.pop("limits", Limits(cell_timeout_s=20.0, interrupt_grace_s=1.0))
    if "data_dir" not in overrides:
        overrides["data_dir"] = fresh_data_dir(state_dir)
    # Pools keep their size in tests (what is held at rest is counted); a test of growth
    # asks for it with pool_max.
    overrides.setdefault("pool_max", 0)
    # Cells stay level with the host's processes: a test's cell that outran the slice on a
    # loaded machine (a first plot, an import) would otherwise wait behind every process of
    # the host, for minutes. The tests of that placement start servers of their own with
    # --cell-slice (tests/server/test_fairness.py) or ask for a slice here.
    overrides.setdefault("cell_slice_s", NEVER_BEHIND_SLICE_S)
    overrides.setdefault("sandbox_start_timeout_s", SANDBOX_START_TIMEOUT_S * slowness())
    config = ServerConfig(
        tcp_port=0,
        http_port=0,
        backend="gvisor",
        pool_size=2,
        data_pool_size=0,
        state_dir=state_dir,
        runtime_dir=RUNTIME_DIR if RUNTIME_DIR.is_dir() else None,
        limits=limits,  # type: ignore[arg-type]
    )
    return replace(config, **overrides)  # type: ignore[arg-type]


class ServerProcess:
    """`cloche serve` as a child process, on free ports, with its log collected."""

    def __init__(
        self,
        state_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        wrapper: tuple[str, ...] = (),
    ) -> None:
        """wrapper: a command to run it under (systemd-run, say), its stderr passed on."""
        import re
        import subprocess
        import sys

        self.state_dir = state_dir
        command = [
            *wrapper,
            sys.executable,
            "-m",
            "cloche.cli",
            "serve",
            "--tcp-port",
            "0",
            "--http-port",
            "0",
            "--state-dir",
            str(state_dir),
            "--pool-size",
            "1",
            *([] if "--data-dir" in args else ["--data-dir", str(fresh_data_dir(state_dir))]),
            "--sandbox-start-timeout",
            f"{SANDBOX_START_TIMEOUT_S * slowness():g}",
            *args,
        ]
        self.process = subprocess.Popen(
            command, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
        )
        self.log: list[str] = []
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            state = re.search(r"state (\S+)$", line)
            if state:
                self.instance = Path(state[1]).name
            match = re.search(r"listening tcp=\S+:(\d+) http=\S+:(\d+)", line)
            if match:
                self.tcp_port, self.http_port = int(match[1]), int(match[2])
                break
        else:
            self.process.wait(60)
            self.process.stderr.close()
            raise RuntimeError("server exited before listening:\n" + "".join(self.log))
        self._drain = threading.Thread(target=self._collect, daemon=True)
        self._drain.start()

    def _collect(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)

    def client(self) -> TCPClient:
        return TCPClient("127.0.0.1", self.tcp_port)

    def stop(self, sig: int = 15, timeout_s: float = 60) -> int:
        """Signal it and wait for its exit status (timeout_s scaled by slowness())."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        code = self.process.wait(timeout_s * slowness())
        self._drain.join(10)
        if self.process.stderr is not None:
            self.process.stderr.close()
        return code


def leftovers(state_dir: Path, instance: str) -> dict[str, list[str]]:
    """Whatever server `instance` left behind: processes, state, mounts, cgroups."""
    import subprocess

    pattern = str(state_dir / instance)
    processes = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True)
    with open("/proc/self/mountinfo") as mountinfo:
        mounts = [line.split()[4] for line in mountinfo if pattern in line.split()[4]]
    from cloche.sandbox.cgroups import tops

    cgroups = [  # at the top of each v1 hierarchy, or under cloche's v2 group
        str(path)
        for top in tops()
        for pattern in (f"*{top}/{instance}", f"{top.strip('/')}/{instance}")
        for path in Path("/sys/fs/cgroup").glob(pattern)
    ]
    state = [str(p) for p in state_dir.iterdir()] if state_dir.exists() else []
    state = [p for p in state if instance in p]
    return {
        "processes": [line for line in processes.stdout.splitlines() if "pgrep" not in line],
        "mounts": mounts,
        "cgroups": cgroups,
        "state": state,
    }


NOTHING_LEFT = {"processes": [], "mounts": [], "cgroups": [], "state": []}


CANARY = "cloche-canary-5b0e6a1d93"  # set in the server's environment by the security suite


# -- clients in processes of their own, for timing beside noise ------------------------------
# A client timed in the test's own process would share its GIL with the thread that collects
# a ServerProcess's log (a line per cell) and with any other client there.

_BUSY_CLIENT = """
import select, sys
from cloche.client.tcp import TCPClient
client = TCPClient("127.0.0.1", int(sys.argv[1]))
session = client.run("j = 0")["session_id"]
print("ready", flush=True)
for line in sys.stdin:  # "go": run the code back to back until "stop"
    client.run(sys.argv[2], session)
    print("going", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:
        client.run(sys.argv[2], session)
    sys.stdin.readline()
    print("stopped", flush=True)
"""

_TIMED_CLIENT = """
import json, sys, time
from cloche.client.tcp import TCPClient
client = TCPClient("127.0.0.1", int(sys.argv[1]))
session = client.run("i = 0")["session_id"]
print("ready", flush=True)
for line in sys.stdin:
    took = []
    for _ in range(int(line)):
        began = time.perf_counter()
        reply = client.run("i += 1", session)
        took.append(time.perf_counter() - began)
        if reply["status"] != "ok":
            raise SystemExit(f"cell failed: {reply}")
    print(json.dumps(took), flush=True)
"""


def _client_process(script: str, *args: str) -> Any:
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":
        process.kill()
        process.wait()
        raise RuntimeError("a client process did not start")
    return process


class BusyClient:
    """A client process with a session of its own (over TCP), running code back to back
    between `go` and `stop`; idle, and its session idle, in between."""

    def __init__(self, port: int, code: str) -> None:
        self.process = _client_process(_BUSY_CLIENT, str(port), code)

    def _say(self, word: str, answer: str) -> None:
        self.process.stdin.write(word + "\n")
        self.process.stdin.flush()
        if self.process.stdout.readline().strip() != answer:
            raise RuntimeError(f"the busy client did not answer {word!r} ({self.process.poll()})")

    def go(self) -> None:
        """Start; returns once its first cell has run."""
        self._say("go", "going")

    def stop(self) -> None:
        """Stop; returns once its last cell has ended."""
        self._say("stop", "stopped")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)
        self.process.stdout.close()


@contextlib.contextmanager
def busy(*clients: BusyClient) -> Iterator[None]:
    """The clients run their code while the block runs."""
    for client in clients:
        client.go()
    try:
        yield
    finally:
        for client in clients:
            client.stop()


class TimedClient:
    """A client process with a session of its own, timing `i += 1` cells when asked."""

    def __init__(self, port: int) -> None:
        self.process = _client_process(_TIMED_CLIENT, str(port))

    def cells(self, count: int) -> list[float]:
        """Seconds each of count cells took, one after another."""
        import json

        self.process.stdin.write(f"{count}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the timed client exited ({self.process.wait()})")
        return [float(x) for x in json.loads(line)]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)
        self.process.stdout.close()


def make_test_ca(directory: Path, host: str) -> tuple[Path, ssl.SSLContext]:
    """A CA of a test's own (its certificate in directory/test-ca.pem) and a server context
    with a certificate it signed for the address host (and in directory/server.pem)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cloche test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_file = directory / "test-ca.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    chain = directory / "server.pem"
    chain.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(chain)
    return ca_file, context


# The E2B front end's tests (tests/e2b): two tenants' tokens, one of E2B's key form.
E2B_KEY = "e2b_0123456789abcdef0123456789abcdef01234567"
E2B_OTHER = "e2b_other_tenant_token"
