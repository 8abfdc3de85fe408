"""The container image: its size, build times, start-to-first-cell, and warm cells against
a server on the host, in one run.

    .venv/bin/python benchmarks/bench_container.py [--cells N] [--cold] [--markdown FILE]

Needs a running Docker daemon and the base image (scripts/image.sh makes it). Measures:

1. Build: `scripts/image.sh` with nothing changed (all layers cached), and after a change to
   cloche's source (a copy of the build context with one comment added: only the layers from
   `COPY src` on are rebuilt). With --cold also `--no-cache` (every layer: pip downloads the
   sandbox runtime; minutes).
2. The image's size.
3. Start to first cell: from `docker run` (the README's flags) to the answer of the first
   cell over TCP; the same for `cloche serve` on the host (./run.sh's server).
4. Warm cells: `1+1` over TCP in one session, on the host, in the container at its bridge
   address (as a cluster reaches a pod), and in the container through its published port
   (Docker's userland proxy adds a hop), measured in alternating blocks so that all see the
   same machine; medians and their ratios.

Everything it starts is stopped and removed (containers, their volumes, the temporary
image and build context).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from cloche.client.tcp import TCPClient
from cloche.errors import ClocheError

REPO = Path(__file__).resolve().parent.parent
TAG = "cloche:bench"
CONTEXT_FILES = (
    "Dockerfile",
    ".dockerignore",
    "pyproject.toml",
    "README.md",
    "runtime-requirements.txt",
    "scripts",
    "src",
)
RUN_FLAGS = ("--cap-add", "SYS_ADMIN", "--security-opt", "seccomp=unconfined")


def docker(*args: str, timeout_s: float = 600.0) -> str:
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout_s, check=True
    )
    return done.stdout.strip()


def timed_build(context: Path, *options: str) -> float:
    started = time.perf_counter()
    subprocess.run(
        [str(context / "scripts" / "image.sh"), TAG, *options],
        capture_output=True,
        timeout=3600,
        check=True,
    )
    return time.perf_counter() - started


def copy_context(into: Path) -> Path:
    into.mkdir()
    for name in CONTEXT_FILES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, into / name)
    return into


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def first_cell(port: int, started: float, timeout_s: float = 180.0) -> float:
    """Seconds from `started` to the answer of a first cell on the server at `port`."""
    deadline = started + timeout_s
    while time.perf_counter() < deadline:
        try:
            with TCPClient("127.0.0.1", port) as client:
                if client.run("1 + 1").get("output") == "2\n":
                    return time.perf_counter() - started
        except (OSError, ValueError, ClocheError):  # docker-proxy accepts, then closes
            time.sleep(0.05)  # polling for the server to listen, with a deadline
    raise TimeoutError(f"no first cell on port {port} within {timeout_s} s")


class HostServer:
    """`cloche serve` on the host, as ./run.sh runs it (on free ports, a private state dir)."""

    def __init__(self, state_dir: Path) -> None:
        self.tcp_port, self.http_port = free_port(), free_port()
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "cloche"),
                "serve",
                "--tcp-port",
                str(self.tcp_port),
                "--http-port",
                str(self.http_port),
                "--state-dir",
                str(state_dir),
                "--data-pool-size",
                "0",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(120)


class ContainerServer:
    """The image run with the README's flags, on free ports."""

    def __init__(self) -> None:
        self.name = f"cloche-bench-{uuid.uuid4().hex[:8]}"
        self.tcp_port, self.http_port = free_port(), free_port()
        self.started = time.perf_counter()
        docker(
            "run",
            "-d",
            "--name",
            self.name,
            *RUN_FLAGS,
            "-e",
            "CLOCHE_DATA_POOL_SIZE=0",
            "-p",
            f"127.0.0.1:{self.tcp_port}:8000",
            "-p",
            f"127.0.0.1:{self.http_port}:8080",
            TAG,
        )

    def stop(self) -> None:
        subprocess.run(
            ["docker", "rm", "--force", "--volumes", self.name], capture_output=True, check=False
        )


def warm_cells(client: TCPClient, session: str, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        reply = client.run("1+1", session)
        samples.append((time.perf_counter() - started) * 1000)
        assert reply["output"] == "2\n", reply
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, default=2000, help="warm cells per server")
    parser.add_argument("--blocks", type=int, default=10, help="alternating blocks")
    parser.add_argument("--cold", action="store_true", help="also time a --no-cache build")
    parser.add_argument("--markdown", type=Path, help="write the results as markdown here")
    args = parser.parse_args()

    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="cloche-bench-") as tmp:
        work = Path(tmp)
        context = copy_context(work / "context")
        if args.cold:
            results["build_cold_s"] = timed_build(context, "--no-cache")
        timed_build(context)  # make sure every layer is cached
        results["build_cached_s"] = timed_build(context)
        init = context / "src" / "cloche" / "__init__.py"
        init.write_text(init.read_text() + "# changed for a benchmark\n")
        results["build_after_source_change_s"] = timed_build(context)
        results["image_mib"] = int(docker("image", "inspect", "--format", "{{.Size}}", TAG)) / (
            1 << 20
        )

        # One after the other, so that neither start competes with the other for the cores.
        container = ContainerServer()
        host: HostServer | None = None
        try:
            results["first_cell_container_s"] = first_cell(container.tcp_port, container.started)
            host = HostServer(work / "state")
            results["first_cell_host_s"] = first_cell(host.tcp_port, host.started)
            address = docker(
                "inspect", "--format", "{{.NetworkSettings.IPAddress}}", container.name
            )
            addresses = {
                "host": ("127.0.0.1", host.tcp_port),
                "container": (address, 8000),  # on the bridge, as a cluster's pod IP
                "container_proxied": ("127.0.0.1", container.tcp_port),  # via docker-proxy
            }
            samples: dict[str, list[float]] = {name: [] for name in addresses}
            clients = {name: TCPClient(*where) for name, where in addresses.items()}
            sessions = {name: str(c.run("0")["session_id"]) for name, c in clients.items()}
            for name in clients:
                warm_cells(clients[name], sessions[name], 200)  # warm-up, not counted
            per_block = max(1, args.cells // args.blocks)
            for _ in range(args.blocks):
                for name in addresses:
                    samples[name] += warm_cells(clients[name], sessions[name], per_block)
            for c in clients.values():
                c.close()
        finally:
            container.stop()
            if host is not None:
                host.stop()
            subprocess.run(["docker", "image", "rm", TAG], capture_output=True, check=False)
    for name, values in samples.items():
        values.sort()
        results[f"warm_cell_{name}_p50_ms"] = statistics.median(values)
        results[f"warm_cell_{name}_p99_ms"] = values[int(len(values) * 0.99) - 1]
    for name in ("container", "container_proxied"):
        results[f"warm_cell_{name}_ratio_p50"] = (
            results[f"warm_cell_{name}_p50_ms"] / results["warm_cell_host_p50_ms"]
        )
    print(json.dumps(results, indent=2))
    if args.markdown:
        args.markdown.write_text(markdown(results, args, len(samples["host"])))
    return 0


def markdown(results: dict[str, float], args: argparse.Namespace, cells: int) -> str:
    rows = [
        ("image size", f"{results['image_mib']:.0f} MiB"),
        *(
            [("build, cold (`--no-cache`; base image present)", f"{results['build_cold_s']:.0f} s")]
            if "build_cold_s" in results
            else []
        ),
        ("build, nothing changed (all layers cached)", f"{results['build_cached_s']:.1f} s"),
        ("build after a change to src/", f"{results['build_after_source_change_s']:.1f} s"),
        (
            "start to first cell, container (`docker run` → answer)",
            f"{results['first_cell_container_s']:.2f} s",
        ),
        (
            "start to first cell, host (`cloche serve` → answer)",
            f"{results['first_cell_host_s']:.2f} s",
        ),
        (
            f"warm cell p50, container at its bridge IP ({cells} cells)",
            f"{results['warm_cell_container_p50_ms']:.3f} ms",
        ),
        (f"warm cell p50, host ({cells} cells)", f"{results['warm_cell_host_p50_ms']:.3f} ms"),
        (
            "warm cell p99, container / host",
            f"{results['warm_cell_container_p99_ms']:.3f} / "
            f"{results['warm_cell_host_p99_ms']:.3f} ms",
        ),
        (
            "warm cell p50, container through a published port (docker-proxy)",
            f"{results['warm_cell_container_proxied_p50_ms']:.3f} ms",
        ),
        (
            "warm cell p50 ratio to the host: container / through docker-proxy",
            f"{results['warm_cell_container_ratio_p50']:.2f} / "
            f"{results['warm_cell_container_proxied_ratio_p50']:.2f}",
        ),
    ]
    lines = ["| what | measured |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]
    return "\n".join(lines) + f"\n\n({args.blocks} alternating blocks; `{' '.join(sys.argv)}`)\n"


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("run as root (runsc on the host, and the Docker daemon)")
    sys.exit(main())
