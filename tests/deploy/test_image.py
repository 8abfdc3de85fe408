"""The container image, built and run with the README's flags: it serves as ./run.sh does.

Needs Docker (a daemon is started for the run when none answers) and builds the base image
with mmdebstrap when it is missing (cached by the daemon across runs)."""

from __future__ import annotations

import ipaddress
import json

import pytest
import yaml

from cloche.client.tcp import TCPClient
from cloche.sandbox import cgroups
from dockerd import RUN_FLAGS
from support import REPO, slowness

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800 * slowness())]

CGROUP_WARNING = "no writable cgroups"
V2 = cgroups.host().version == 2
# On cgroup v2, Docker gives a container a cgroup namespace of its own, whose cgroups cloche
# makes writable (host.py); in the host's namespace (v1's default) they stay read-only.
HOST_CGROUPNS = ("--cgroupns", "host") if V2 else ()
# Processes that together hold far more than a backstop of --memory-mib 256 (+ /tmp + 128
# MiB), each under its RLIMIT_AS: the memory cgroup's OOM killer ends the sandbox.
MEMORY_HOG = (
    "import os, resource, time\n"
    "limit = resource.getrlimit(resource.RLIMIT_AS)[0]\n"
    "status = open('/proc/self/status').read()\n"
    "size = int(status.split('VmSize:')[1].split()[0]) * 1024\n"
    "block = limit - size - 32 * 1024**2  # what a child may take under its rlimit\n"
    "for _ in range(12):\n"
    "    if os.fork() == 0:\n"
    "        try:\n"
    "            block = bytearray(block)\n"
    "            for i in range(0, len(block), 4096): block[i] = 1\n"
    "        except MemoryError: pass\n"
    "        time.sleep(30); os._exit(0)\n"
    "time.sleep(30)"
)


def test_tcp_greets_and_keeps_a_session_s_state(served) -> None:
    with TCPClient("127.0.0.1", served.tcp_port) as client:
        assert client.greeting["status"] == "ok"
        sid = client.run("x = 1")["session_id"]
        assert client.run("x + 1", sid)["output"] == "2\n"


def test_terrarium_post_runs_a_cell(served) -> None:
    answer = served.post("/", {"code": "print(6 * 7)"})
    assert answer["success"] is True
    assert answer["std_out"] == "42\n"


def test_health_and_metrics_answer(served) -> None:
    assert served.get("/health") == (200, '{"status":"ok"}')
    status, metrics = served.get("/metrics")
    assert status == 200
    assert "cloche_cells_total" in metrics and "cloche_sessions_created_total" in metrics


def test_code_runs_in_gvisor_inside_the_container(served) -> None:
    answer = served.post(
        "/",
        {
            "code": "import subprocess\n"
            "print(subprocess.run(['dmesg'], capture_output=True, text=True).stdout)\n"
            "print(open('/proc/version').read())"
        },
    )
    assert "Starting gVisor" in str(answer["std_out"])  # gVisor's own kernel log
    assert "Linux version 4.4.0" in str(answer["std_out"])  # the kernel gVisor pretends to be


def test_without_writable_cgroups_it_says_which_limits_it_cant_enforce(run_container) -> None:
    """Read-only cgroups that are the host's (v1's default; on v2 with the host's cgroup
    namespace): nothing to make writable, and a warning that names what is not enforced."""
    container = run_container(
        *RUN_FLAGS,
        *HOST_CGROUPNS,
        env={"CLOCHE_POOL_SIZE": "1", "CLOCHE_DATA_POOL_SIZE": "0"},
    ).ready()
    assert container.post("/", {"code": "print(1)"})["std_out"] == "1\n"
    warning = [line for line in container.logs().splitlines() if CGROUP_WARNING in line]
    assert len(warning) == 1, container.logs()
    assert "--cpu-quota" in warning[0] and "--freeze-idle" in warning[0]


def compose_flags() -> tuple[list[str], dict[str, str]]:
    """compose.yaml's cloche service as `docker run` flags and environment."""
    service = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["cloche"]
    flags = [f"--cap-add={capability}" for capability in service.get("cap_add", [])]
    for option in service.get("security_opt", []):
        kind, _, value = option.partition("=")
        if kind == "seccomp" and not value.startswith("/") and value != "unconfined":
            value = str(REPO / value)  # relative to the compose file
        flags.append(f"--security-opt={kind}={value}")
    if "cgroup" in service:
        flags.append(f"--cgroupns={service['cgroup']}")
    return flags, {key: str(value) for key, value in service.get("environment", {}).items()}


@pytest.mark.skipif(not V2, reason="a cgroup v2 host: on v1 the test above holds")
def test_with_compose_s_settings_on_cgroup_v2_each_sandbox_s_memory_backstop_holds(
    run_container,
) -> None:
    """The container in its own cgroup namespace (Docker's default on v2): cloche makes its
    cgroups writable, moves out of the way of its sandboxes' groups, and enforces their
    limits; a sandbox over its memory backstop is killed, and told apart as `memory`."""
    flags, env = compose_flags()
    env |= {"CLOCHE_POOL_SIZE": "1", "CLOCHE_DATA_POOL_SIZE": "0", "CLOCHE_MEMORY_MIB": "256"}
    # The hog's cell may take a minute (more on a slow machine) before the OOM killer ends
    # it: the server's --cell-timeout (30 s) would cap what the request asks.
    hog_timeout_s = round(60 * slowness())
    env["CLOCHE_CELL_TIMEOUT"] = str(hog_timeout_s)
    container = run_container(*flags, env=env).ready()
    logs = container.logs()
    assert CGROUP_WARNING not in logs, logs
    assert "sandbox cgroups: cgroup v2, under /sys/fs/cgroup (remounted read-write" in logs, logs
    assert container.exec("cat", "/proc/1/cgroup").strip() == "0::/cloche-server"  # tini
    session = str(container.post("/v1/sessions", {})["id"])
    assert container.post(f"/v1/sessions/{session}/execute", {"code": "x = 1"})["status"] == "ok"
    hog = container.post("/v1/sessions", {})["id"]
    cell = {"code": MEMORY_HOG, "timeout": hog_timeout_s}
    killed = container.post(f"/v1/sessions/{hog}/execute", cell)
    assert (killed["status"], killed["end_reason"]) == ("killed", "memory"), killed
    assert "OOM killer" in str(killed["message"]), killed
    reply = container.post(f"/v1/sessions/{session}/execute", {"code": "print(x + 1)"})
    assert reply["stdout"] == "2\n", reply  # the other session lives on


def test_with_the_host_s_cgroups_mounted_it_enforces_them_all(run_container) -> None:
    """The host's hierarchy mounted read-write, in the host's cgroup namespace (on v2 a
    cgroup namespace of its own could not reach its groups there)."""
    container = run_container(
        *RUN_FLAGS,
        *HOST_CGROUPNS,
        "-v",
        "/sys/fs/cgroup:/sys/fs/cgroup:rw",
        env={"CLOCHE_POOL_SIZE": "1", "CLOCHE_DATA_POOL_SIZE": "0"},
    ).ready()
    assert container.post("/", {"code": "print(1)"})["std_out"] == "1\n"
    assert CGROUP_WARNING not in container.logs()


def test_docker_stop_shuts_it_down_cleanly_with_cloche_settings_from_env(run_container) -> None:
    container = run_container(
        *RUN_FLAGS,
        env={"CLOCHE_LOG_FORMAT": "json", "CLOCHE_POOL_SIZE": "1", "CLOCHE_DATA_POOL_SIZE": "0"},
    ).ready()
    with TCPClient("127.0.0.1", container.tcp_port) as client:
        assert client.run("1 + 1")["output"] == "2\n"
    assert container.stop(timeout_s=60) == 0  # SIGTERM reached cloche (not SIGKILL: 137)
    lines = [json.loads(line) for line in container.logs().splitlines() if line.strip()]
    listening = next(line for line in lines if line["message"].startswith("cloche listening"))
    assert listening["pool"] == 1 and listening["tcp"] == "0.0.0.0:8000"
    messages = [line["message"] for line in lines]
    assert "shutting down" in messages
    assert messages[-1] == "stopped"


def test_the_shipped_seccomp_profile_replaces_unconfined(run_container) -> None:
    profile = REPO / "deploy" / "seccomp.json"
    container = run_container(
        "--cap-add",
        "SYS_ADMIN",
        "--security-opt",
        f"seccomp={profile}",
        "--security-opt",
        "apparmor=unconfined",
        env={"CLOCHE_POOL_SIZE": "1", "CLOCHE_DATA_POOL_SIZE": "0"},
    ).ready()
    answer = container.post("/", {"code": "import os; print(os.getpid())"})
    assert answer["success"] is True, answer


def test_the_kubernetes_security_context_is_enough(run_container) -> None:
    """The StatefulSet's securityContext, as docker flags: its capabilities only, no new
    privileges, a read-only root with /run and /tmp writable, the shipped seccomp profile."""
    manifest = yaml.safe_load((REPO / "deploy" / "kubernetes" / "statefulset.yaml").read_text())
    context = manifest["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    flags = ["--cap-drop", "ALL"]
    for capability in context["capabilities"]["add"]:
        flags += ["--cap-add", capability]
    if context["allowPrivilegeEscalation"] is False:
        flags += ["--security-opt", "no-new-privileges"]
    if context["readOnlyRootFilesystem"]:
        flags += ["--read-only", "--tmpfs", "/run:exec", "--tmpfs", "/tmp"]
    flags += ["--security-opt", f"seccomp={REPO / 'deploy' / 'seccomp.json'}"]
    if context["appArmorProfile"]["type"] == "Unconfined":
        flags += ["--security-opt", "apparmor=unconfined"]
    container = run_container(
        *flags, env={"CLOCHE_POOL_SIZE": "1", "CLOCHE_DATA_POOL_SIZE": "0"}
    ).ready()
    with TCPClient("127.0.0.1", container.tcp_port) as client:
        sid = client.run("x = 20")["session_id"]
        assert client.run("x * 2 + 2", sid)["output"] == "42\n"


def test_a_session_survives_docker_restart(run_container) -> None:
    container = run_container(
        *RUN_FLAGS,
        env={"CLOCHE_POOL_SIZE": "1", "CLOCHE_DATA_POOL_SIZE": "0"},
    ).ready()
    with TCPClient("127.0.0.1", container.tcp_port) as client:
        sid = client.run("gen = iter(range(10)); next(gen)")["session_id"]
    container.restart()  # SIGTERM pauses it to the volume; the new server resumes it
    with TCPClient("127.0.0.1", container.tcp_port) as client:
        reply = client.run("next(gen)", sid)
    assert (reply["status"], reply.get("output")) == ("ok", "1\n"), (reply, container.logs())
    assert "session paused" in container.logs() and "session resumed" in container.logs()


def _listening(proc_net: str) -> set[tuple[str, int]]:
    """(address, port) of the LISTEN sockets in /proc/net/tcp and tcp6 text."""
    found = set()
    for line in proc_net.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[3] != "0A":  # 0A: TCP_LISTEN
            continue
        address, port = fields[1].split(":")
        raw = bytes.fromhex(address)
        if len(raw) == 4:
            host = ".".join(str(b) for b in reversed(raw))
        else:  # four little-endian words
            words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
            host = str(ipaddress.IPv6Address(b"".join(words)))
        found.add((host, int(port, 16)))
    return found


def test_the_image_listens_only_on_its_two_documented_ports(served) -> None:
    """0.0.0.0 inside the container is for the REPL (8000) and HTTP (8080) ports alone."""
    served.post("/", {"code": "1"})  # a sandbox runs meanwhile: it opens nothing here
    proc_net = served.exec("cat", "/proc/net/tcp", "/proc/net/tcp6")
    assert _listening(proc_net) == {("0.0.0.0", 8000), ("0.0.0.0", 8080)}
