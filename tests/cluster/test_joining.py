"""Joining a Ray cluster started by someone else (`ray start --head`): only one that enforces
Ray's token authentication, with the token given; any other only when told --cluster-insecure."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support import ServerProcess, require_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

RAY = Path(sys.executable).parent / "ray"

# Stops what cloche's front ends leave on a joined cluster (its node agents, which pause their
# sessions and remove their sandboxes), as an operator would before stopping the cluster.
STOP_AGENTS = """
import sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
for actor in ray.util.list_named_actors(all_namespaces=True):
    handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
    if actor["name"].startswith("cloche-agent-"):
        ray.get(handle.stop.remote(), timeout=120)
    ray.kill(handle)
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def ray_env(temp: str, token: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(
        RAY_TMPDIR=temp,
        RAY_USAGE_STATS_ENABLED="0",
        # One machine, on loopback alone: Ray would otherwise swap 127.0.0.1 for the
        # machine's external address.
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
    )
    if token is not None:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    return env


@contextlib.contextmanager
def ray_head(state: Path, token: Path | None) -> Iterator[str]:
    """A one-node Ray cluster on loopback, as `ray start --head` makes it (with token
    authentication when given a token file); yields its GCS address. Everything of it, and
    of cloche's agents on it, is gone afterwards."""
    temp = tempfile.mkdtemp(prefix="cloche-head-", dir="/tmp")  # Ray's socket paths: short
    env = ray_env(temp, token)
    address = f"127.0.0.1:{free_port()}"
    head = subprocess.Popen(
        [
            str(RAY),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={address.rpartition(':')[2]}",
            "--num-cpus=0",
            '--resources={"cloche_node": 1}',
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # polling: the GCS says nothing when it is up
            assert head.poll() is None, "ray start --head exited"
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", int(address.rpartition(":")[2])), timeout=1),
            ):
                break
            assert time.monotonic() < deadline, "Ray's GCS never listened"
            time.sleep(0.1)
        yield address
        stopped = subprocess.run(
            [sys.executable, "-c", STOP_AGENTS, address],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert stopped.returncode == 0, stopped.stderr[-3000:]
    finally:
        head.send_signal(signal.SIGTERM)
        head.wait(120)
        left = subprocess.run(["pgrep", "-f", temp], capture_output=True, text=True).stdout
        for pid in left.split():  # Ray's own, started by our head: they name its temp dir
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
        for pattern in (temp, str(state)):
            found = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True)
            assert found.stdout.strip() == "", found.stdout


def make_token(path: Path) -> Path:
    path.write_text("a-token-of-the-operator-s-" + os.urandom(8).hex())
    path.chmod(0o600)
    return path


def runs_a_session(server: ServerProcess) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=120) as http:
        made = http.post("/v1/sessions", json={})
        assert made.status_code == 201, made.text
        session = made.json()["id"]
        done = http.post(f"/v1/sessions/{session}/execute", json={"code": "6 * 7"})
        assert done.json()["result"] == {"text/plain": "42"}, done.text
        assert http.delete(f"/v1/sessions/{session}").status_code == 204


def refused(state: Path, *args: str, env: dict[str, str] | None = None) -> str:
    with pytest.raises(RuntimeError, match="exited before listening") as refusal:
        ServerProcess(state, *args, env=env)
    return str(refusal.value)


def test_a_cluster_without_token_auth_is_refused_unless_insecure_is_asked(
    tmp_path: Path,
) -> None:
    require_cluster()
    state = tmp_path / "state"
    with ray_head(state, token=None) as address:
        args = ("--cluster", address, "--cluster-agent-port", "0")
        said = refused(state, *args)
        assert "does not enforce token authentication" in said, said
        assert "RAY_AUTH_MODE=token" in said and "--cluster-insecure" in said, said
        server = ServerProcess(state, *args, "--cluster-insecure")
        try:
            assert any("--cluster-insecure" in line and "WARNING" in line for line in server.log), (
                "".join(server.log)
            )
            runs_a_session(server)
        finally:
            assert server.stop() == 0, "".join(server.log[-30:])


def test_a_cluster_with_token_auth_is_joined_with_its_token_alone(tmp_path: Path) -> None:
    require_cluster()
    state = tmp_path / "state"
    token = make_token(tmp_path / "ray-token")
    with ray_head(state, token) as address:
        args = ("--cluster", address, "--cluster-agent-port", "0")
        said = refused(state, *args)  # no token given to cloche
        assert "requires a token" in said and "RAY_AUTH_TOKEN" in said, said
        wrong = make_token(tmp_path / "wrong-token")
        said = refused(
            state, *args, env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)}
        )
        assert "requires a token" in said, said
        server = ServerProcess(
            state, *args, env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
        )
        try:
            assert "requires token authentication" in "".join(server.log)
            runs_a_session(server)
        finally:
            assert server.stop() == 0, "".join(server.log[-30:])
        assert token.read_text() not in "".join(server.log)
