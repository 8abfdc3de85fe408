"""deploy/kubernetes/cluster/ (KubeRay) agrees with the server's defaults, the single server's
privileges and the `cluster` extra's Ray; its pods' shell commands do what their comments say
(run against stand-ins for `ray` and `cloche`); the image builds with the extra when asked."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cloche.config import ServerConfig
from support import REPO

DEFAULTS = ServerConfig()
CLUSTER = REPO / "deploy" / "kubernetes" / "cluster"
SINGLE_SERVER = REPO / "deploy" / "kubernetes" / "statefulset.yaml"
DATA_DIR = "/var/lib/cloche"
# The node agent's port (--cluster-agent-port): 7100 until ServerConfig names it.
AGENT_PORT = DEFAULTS.cluster_agent_port
DEADLINE_S = 30.0


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def manifests() -> list[Any]:
    kustomization = load(CLUSTER / "kustomization.yaml")
    return [
        manifest
        for name in kustomization["resources"]
        for manifest in yaml.safe_load_all((CLUSTER / name).read_text())
    ]


def one(manifests: list[Any], kind: str, name: str | None = None) -> Any:
    (found,) = [
        m
        for m in manifests
        if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)
    ]
    return found


@pytest.fixture(scope="module")
def ray_cluster(manifests) -> Any:
    return one(manifests, "RayCluster")


@pytest.fixture(scope="module")
def head(ray_cluster) -> Any:
    return ray_cluster["spec"]["headGroupSpec"]


@pytest.fixture(scope="module")
def worker(ray_cluster) -> Any:
    (group,) = ray_cluster["spec"]["workerGroupSpecs"]
    return group


def container(group: Any) -> Any:
    return group["template"]["spec"]["containers"][0]  # KubeRay's Ray container is the first


def ports(of: Any) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in of["ports"]}


def ray_resources(group: Any) -> dict[str, float]:
    """The JSON of rayStartParams' `resources`, as the shell reads it (it is shell-quoted)."""
    (word,) = shlex.split(group["rayStartParams"]["resources"])
    resources: dict[str, float] = json.loads(word)
    return resources


def test_the_kustomization_applies_every_manifest_here() -> None:
    kustomization = load(CLUSTER / "kustomization.yaml")
    here = {path.name for path in CLUSTER.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == here


def test_ray_is_the_version_the_cluster_extra_pins(ray_cluster, head, worker) -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (pin,) = [
        r for r in pyproject["project"]["optional-dependencies"]["cluster"] if r.startswith("ray")
    ]
    match = re.fullmatch(r"ray==([\d.]+)", pin)
    assert match, f"the cluster extra must pin Ray exactly, not {pin!r}"
    assert ray_cluster["apiVersion"] == "ray.io/v1"
    assert ray_cluster["spec"]["rayVersion"] == match[1]
    assert container(head)["image"] == container(worker)["image"]  # one image, Ray included


# Privileges


def test_workers_have_exactly_the_single_server_s_privileges(worker) -> None:
    single = load(SINGLE_SERVER)["spec"]["template"]
    (single_container,) = single["spec"]["containers"]
    pod = worker["template"]["spec"]
    assert "runtimeClassName" not in pod  # runsc can't run inside gVisor
    assert not pod.get("hostPID") and not pod.get("hostNetwork")
    context = container(worker)["securityContext"]
    assert context == single_container["securityContext"]
    assert "privileged" not in context
    assert "SYS_ADMIN" in context["capabilities"]["add"]
    assert context["seccompProfile"]["type"] in ("Unconfined", "Localhost")
    assert context["readOnlyRootFilesystem"] is True
    writable = {mount["mountPath"] for mount in container(worker)["volumeMounts"]}
    assert {"/run", "/tmp", DATA_DIR} <= writable  # runsc's state, Ray's temp dir, the data


def test_the_head_runs_no_sandbox_and_has_no_privilege(head) -> None:
    assert ray_resources(head) == {"cloche_node": 0}
    assert head["rayStartParams"]["num-cpus"] == "0"
    context = container(head)["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["allowPrivilegeEscalation"] is False
    assert context["seccompProfile"]["type"] == "RuntimeDefault"
    assert "privileged" not in context
    assert context["readOnlyRootFilesystem"] is True
    writable = {mount["mountPath"] for mount in container(head)["volumeMounts"]}
    assert "/tmp" in writable  # Ray's temp dir


def test_every_worker_offers_one_cloche_node(worker) -> None:
    assert ray_resources(worker) == {"cloche_node": 1}


# Ports and probes


def test_the_head_s_probes_hit_health_on_the_http_port(head) -> None:
    head_container = container(head)
    for probe in ("readinessProbe", "livenessProbe"):
        assert head_container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert ports(head_container)["http"] == DEFAULTS.http_port


def test_workers_probe_their_raylet_rather_than_ray_s_dashboard(worker) -> None:
    """KubeRay puts in probes that ask Ray's dashboard agent unless a container has its own;
    the image's minimal Ray serves none."""
    raylet_port = int(worker["rayStartParams"]["node-manager-port"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert container(worker)[probe]["tcpSocket"] == {"port": raylet_port}


def test_the_service_exposes_the_front_end_s_default_ports_on_the_head(
    manifests, ray_cluster, head
) -> None:
    service = one(manifests, "Service")
    assert service["spec"]["selector"] == {
        "ray.io/cluster": ray_cluster["metadata"]["name"],
        "ray.io/node-type": "head",
    }
    service_ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert service_ports == {"repl": DEFAULTS.tcp_port, "http": DEFAULTS.http_port}
    head_ports = ports(container(head))
    for port in service["spec"]["ports"]:
        assert head_ports[port["targetPort"]] == port["port"]


def test_workers_expose_the_agent_port(worker) -> None:
    assert ports(container(worker))["agent"] == AGENT_PORT


def test_ray_s_ports_leave_cloche_s_ports_alone(head, worker) -> None:
    """KubeRay's default metrics port is 8080, cloche's HTTP port: both groups move it, and a
    port named `metrics` keeps KubeRay from adding its own."""
    cloche_ports = {DEFAULTS.tcp_port, DEFAULTS.http_port, AGENT_PORT}
    for group in (head, worker):
        declared = ports(container(group))
        assert len(set(declared.values())) == len(declared)
        metrics = int(group["rayStartParams"]["metrics-export-port"])
        assert declared["metrics"] == metrics
        assert metrics not in cloche_ports
    # Declared ports replace KubeRay's defaults in its head Service: the GCS must be among them.
    assert ports(container(head))["gcs-server"] == 6379
    assert int(worker["rayStartParams"]["node-manager-port"]) not in cloche_ports


# Secrets, data, resources


def test_tokens_and_the_llm_key_come_from_the_secret(head, worker) -> None:
    secret = load(REPO / "deploy" / "kubernetes" / "secret.example.yaml")
    head_env = {item["name"]: item for item in container(head)["env"]}
    assert head_env["CLOCHE_HOST"]["value"] == "0.0.0.0"
    wanted = {
        "CLOCHE_TOKEN": "tokens",
        "CLOCHE_ADMIN_TOKEN": "admin-token",
        "CLOCHE_LLM_API_KEY": "llm-api-key",
    }
    for name, key in wanted.items():
        assert head_env[name]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
        assert head_env[name]["valueFrom"]["secretKeyRef"]["key"] == key
    assert head_env["CLOCHE_LLM_API_KEY"]["valueFrom"]["secretKeyRef"]["optional"] is True
    worker_env = {item["name"]: item for item in container(worker)["env"]}
    assert worker_env["CLOCHE_LLM_API_KEY"] == head_env["CLOCHE_LLM_API_KEY"]
    assert set(wanted.values()) == set(secret["stringData"])


def test_each_worker_keeps_its_data_dir_on_a_volume_of_its_own(worker) -> None:
    volumes = {volume["name"]: volume for volume in worker["template"]["spec"]["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container(worker)["volumeMounts"]}
    claim = volumes[mounts[DATA_DIR]]["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["accessModes"] == ["ReadWriteOnce"]
    assert "storage" in claim["resources"]["requests"]
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"VOLUME {DATA_DIR}\n" in dockerfile and f"CLOCHE_DATA_DIR={DATA_DIR}" in dockerfile


def mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return float(quantity.removesuffix(suffix)) * factor
    return float(quantity) / 2**20


def test_resources_are_requested_and_memory_bounds_the_object_store(head, worker) -> None:
    for group in (head, worker):
        resources = container(group)["resources"]
        assert {"cpu", "memory"} <= resources["requests"].keys()
        limit_mib = mebibytes(resources["limits"]["memory"])
        assert mebibytes(resources["requests"]["memory"]) <= limit_mib
        assert int(group["rayStartParams"]["object-store-memory"]) / 2**20 < limit_mib / 2


def test_the_head_s_metrics_are_scraped_from_the_http_port(head) -> None:
    annotations = head["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(DEFAULTS.http_port)
    assert annotations["prometheus.io/path"] == "/metrics"


# NetworkPolicy


def covers(rule: Any, port: int) -> bool:
    if "ports" not in rule:
        return True  # no ports: every port
    return any(p["port"] <= port <= p.get("endPort", p["port"]) for p in rule["ports"])


def test_only_the_head_reaches_a_worker_s_agent_port(manifests, ray_cluster) -> None:
    name = ray_cluster["metadata"]["name"]
    policy = one(manifests, "NetworkPolicy", "cloche-workers")["spec"]
    assert policy["podSelector"]["matchLabels"] == {
        "ray.io/cluster": name,
        "ray.io/node-type": "worker",
    }
    assert "Ingress" in policy["policyTypes"]
    head_only = [
        {"podSelector": {"matchLabels": {"ray.io/cluster": name, "ray.io/node-type": "head"}}}
    ]
    reaching = [rule for rule in policy["ingress"] if covers(rule, AGENT_PORT)]
    assert reaching and all(rule.get("from") == head_only for rule in reaching)
    # Ray's own traffic still flows between the cluster's pods, on the other ports.
    ray_rules = [rule for rule in policy["ingress"] if covers(rule, 6380)]
    assert ray_rules and all(
        rule["from"] == [{"podSelector": {"matchLabels": {"ray.io/cluster": name}}}]
        for rule in ray_rules
    )


def test_ray_requires_its_token_in_every_pod(ray_cluster, head, worker) -> None:
    """KubeRay makes the token's Secret and gives every Ray container RAY_AUTH_MODE=token and
    the token; the front end, in the head's container, joins with them (it refuses a cluster
    that lets callers without a token in). Nothing here may turn that off."""
    assert ray_cluster["spec"]["authOptions"] == {"mode": "token"}
    for group in (head, worker):
        names = {item["name"] for item in container(group).get("env", [])}
        assert not names & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "CLOCHE_CLUSTER_INSECURE"}
        assert "--cluster-insecure" not in " ".join(container(group)["args"])


def test_clients_reach_only_the_front_end_s_ports_on_the_head(manifests, ray_cluster) -> None:
    name = ray_cluster["metadata"]["name"]
    policy = one(manifests, "NetworkPolicy", "cloche-head")["spec"]
    assert policy["podSelector"]["matchLabels"] == {
        "ray.io/cluster": name,
        "ray.io/node-type": "head",
    }
    assert "Ingress" in policy["policyTypes"]
    from_anywhere = [rule for rule in policy["ingress"] if "from" not in rule]
    opened = {(p["port"], p["protocol"]) for rule in from_anywhere for p in rule["ports"]}
    assert opened == {(DEFAULTS.tcp_port, "TCP"), (DEFAULTS.http_port, "TCP")}
    for rule in policy["ingress"]:
        if "from" in rule:  # the GCS and the rest of Ray: the cluster's own pods only
            assert rule["from"] == [{"podSelector": {"matchLabels": {"ray.io/cluster": name}}}]


# The pods' commands, run by bash against stand-ins for `ray` and `cloche`

RAY_STUB = """#!/bin/bash
# ray start: record the arguments, say it is up, run until SIGTERM (or until told to fail).
case "$1" in
    start)
        printf '%s\\0' "$@" >"$STUBS/ray.argv"
        trap 'echo ray >>"$STUBS/stopped"; exit 0' TERM
        touch "$STUBS/ray-up"
        until [ -e "$STUBS/ray-fails" ]; do sleep 0.05; done
        exit 3 ;;
    health-check) [ -e "$STUBS/ray-up" ] ;;
    *) exit 2 ;;
esac
"""
CLOCHE_STUB = """#!/bin/bash
printf '%s\\0' "$@" >"$STUBS/cloche.argv"
trap 'echo cloche >>"$STUBS/stopped"; exit 0' TERM
while :; do sleep 0.05; done
"""


@pytest.fixture
def stubs(tmp_path: Path) -> Path:
    for name, text in (("ray", RAY_STUB), ("cloche", CLOCHE_STUB)):
        path = tmp_path / name
        path.write_text(text)
        path.chmod(0o755)
    return tmp_path


def generated_ray_start(group: Any, node_type: str) -> str:
    """$KUBERAY_GEN_RAY_START_CMD as KubeRay makes it (convertParamMap, KubeRay 1.6): sorted
    rayStartParams plus the ones it adds, `--key=value`, a bare `--key` for "true"."""
    params = dict(group["rayStartParams"])
    params.setdefault("dashboard-agent-listen-port", "52365")
    params["block"] = "true"
    if node_type == "head":
        params.setdefault("dashboard-host", "0.0.0.0")
        head = "ray start --head"
    else:
        params.setdefault("address", "cloche-head-svc.default.svc.cluster.local:6379")
        head = "ray start"
    flags = "".join(
        f" --{key} " if value.lower() == "true" else f" --{key}={value} "
        for key, value in sorted(params.items())
    )
    return head + flags


def start(group: Any, node_type: str, stubs: Path) -> subprocess.Popen[bytes]:
    spec = container(group)
    command = spec["command"]
    assert command[:2] == ["tini", "--"]  # PID 1: forwards SIGTERM, reaps runsc's orphans
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "STUBS": str(stubs),
        "KUBERAY_GEN_RAY_START_CMD": generated_ray_start(group, node_type),
    }
    return subprocess.Popen([*command[2:], *spec["args"]], env=env, cwd=stubs)


def wait_for(path: Path, process: subprocess.Popen[bytes]) -> list[str]:
    deadline = time.monotonic() + DEADLINE_S
    while not path.exists():
        assert process.poll() is None, f"the container's command ended: {process.returncode}"
        assert time.monotonic() < deadline, f"{path.name} did not appear"
        time.sleep(0.05)  # polling for the stand-in's record, with a deadline
    return path.read_text().split("\0")[:-1]


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(DEADLINE_S)


def flag_value(argv: list[str], flag: str) -> str:
    (value,) = [arg.removeprefix(f"--{flag}=") for arg in argv if arg.startswith(f"--{flag}=")]
    return value


def test_the_overwrite_annotation_keeps_the_pods_commands(ray_cluster) -> None:
    assert ray_cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"


def test_a_worker_runs_kuberay_s_ray_start_with_its_resources_unquoted(
    worker, stubs, processes
) -> None:
    process = start(worker, "worker", stubs)
    processes.append(process)
    argv = wait_for(stubs / "ray.argv", process)
    assert argv[0] == "start" and "--block" in argv
    assert json.loads(flag_value(argv, "resources")) == {"cloche_node": 1}
    process.send_signal(signal.SIGTERM)  # `exec`: ray start itself gets the kubelet's signal
    assert process.wait(DEADLINE_S) == 0
    assert (stubs / "stopped").read_text() == "ray\n"


def test_the_head_starts_ray_then_the_front_end_and_stops_the_front_end_first(
    head, stubs, processes
) -> None:
    process = start(head, "head", stubs)
    processes.append(process)
    ray_argv = wait_for(stubs / "ray.argv", process)
    assert ray_argv[:2] == ["start", "--head"]
    assert json.loads(flag_value(ray_argv, "resources")) == {"cloche_node": 0}
    system_config = json.loads(flag_value(ray_argv, "system-config"))
    assert system_config["health_check_failure_threshold"] == 3
    assert wait_for(stubs / "cloche.argv", process) == ["serve", "--cluster", "auto"]
    process.send_signal(signal.SIGTERM)
    assert process.wait(DEADLINE_S) == 0
    assert (stubs / "stopped").read_text() == "cloche\nray\n"


def test_the_head_container_ends_when_ray_ends(head, stubs, processes) -> None:
    process = start(head, "head", stubs)
    processes.append(process)
    wait_for(stubs / "cloche.argv", process)
    (stubs / "ray-fails").touch()
    assert process.wait(DEADLINE_S) == 3  # the kubelet restarts the container
    assert (stubs / "stopped").read_text().splitlines()[0] == "cloche"


# The cluster image


def test_the_image_installs_the_extras_it_is_told(tmp_path: Path) -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG CLOCHE_EXTRAS=\"\"$", dockerfile, re.MULTILINE)
    match = re.search(r"^RUN \.venv/bin/python -c '([^']*)' >requirements\.txt", dockerfile, re.M)
    assert match, "the Dockerfile's step that lists the requirements"
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def requirements(extras: str) -> list[str]:
        done = subprocess.run(
            ["python3", "-c", match[1]],
            env={**os.environ, "CLOCHE_EXTRAS": extras},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout.splitlines()

    assert requirements("") == pyproject["dependencies"]
    cluster = requirements("cluster")
    assert cluster == pyproject["dependencies"] + pyproject["optional-dependencies"]["cluster"]
    assert any(line.startswith("ray==") for line in cluster)


DOCKER_STUB = """#!/bin/bash
# docker image inspect: the base image is there; docker build: record the arguments.
case "$1" in
    image) exit 0 ;;
    build) printf '%s\\0' "$@" >"$STUBS/docker.argv" ;;
    *) exit 2 ;;
esac
"""


@pytest.mark.parametrize(
    ("args", "extras", "tag"),
    [
        ([], "", "cloche:latest"),
        (["--cluster"], "cluster", "cloche:cluster"),
        (["--cluster", "registry.example/cloche:c1"], "cluster", "registry.example/cloche:c1"),
    ],
)
def test_image_sh_builds_the_cluster_image_when_asked(
    tmp_path: Path, args: list[str], extras: str, tag: str
) -> None:
    docker = tmp_path / "docker"
    docker.write_text(DOCKER_STUB)
    docker.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "STUBS": str(tmp_path)}
    env.pop("CLOCHE_EXTRAS", None)
    subprocess.run(
        [str(REPO / "scripts" / "image.sh"), *args],
        env=env,
        capture_output=True,
        timeout=60,
        check=True,
    )
    argv = (tmp_path / "docker.argv").read_text().split("\0")[:-1]
    assert f"CLOCHE_EXTRAS={extras}" in argv
    assert argv[argv.index("--tag") + 1] == tag


# The pods in Docker: the cluster image, each pod's command, environment (what KubeRay adds)
# and securityContext as `docker run` flags, on one Docker network. The front end is a
# stand-in Ray driver (these tests are about the pods' Ray and privileges); the node agent a
# Ray actor placed as the front end places agents, running a cloche server on the agent port.

CLUSTER_IMAGE = "cloche:test-cluster"
PATH_IN_IMAGE = "/opt/cloche/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FRONT_END_STAND_IN = """#!/bin/bash
exec python -u -c '
import signal, sys, time, ray
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
ray.init("auto", logging_level="WARNING")
print("front end stand-in: joined Ray", flush=True)
while True:
    time.sleep(1)
'
"""
NODES = """
import json, ray
ray.init("auto", logging_level="WARNING")
print(json.dumps([n["Resources"] for n in ray.nodes() if n["Alive"]]))
"""
AGENT = """
import json, os, subprocess, time, urllib.request
import ray
from cloche.client.tcp import TCPClient

ray.init("auto", logging_level="WARNING")


@ray.remote(resources={"cloche_node": 1}, num_cpus=0)
class Agent:
    def start(self, port):
        self.server = subprocess.Popen(
            ["cloche", "serve", "--tcp-port", str(port), "--http-port", str(port + 1),
             "--pool-size", "1", "--data-pool-size", "0", "--data-template", "false"],
            env={**os.environ, "CLOCHE_HOST": "0.0.0.0", "CLOCHE_TOKEN": "agent-token"},
        )
        deadline = time.monotonic() + 120
        while self.server.poll() is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/health", timeout=5)
                return ray.util.get_node_ip_address()
            except OSError:
                time.sleep(0.5)  # polling for /health, with a deadline
        raise RuntimeError(f"the server did not start: {self.server.poll()}")

    def stop(self):
        self.server.terminate()
        return self.server.wait(60)


agent = Agent.remote()
address = ray.get(agent.start.remote(PORT), timeout=180)
with TCPClient(address, PORT) as client:
    sid = client.run("x = 1", token="agent-token")["session_id"]
    cells = [
        client.run("x + 1", sid, token="agent-token")["output"],
        client.run("print(open('/proc/version').read())", sid, token="agent-token")["output"],
    ]
print(json.dumps({"cells": cells, "stopped": ray.get(agent.stop.remote(), timeout=90)}))
"""


def docker(*args: str, timeout_s: float = 120.0, check: bool = True) -> str:
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout.strip()


def docker_flags(spec: Any) -> list[str]:
    """A container's securityContext and volumes as `docker run` flags (emptyDirs and the
    ephemeral data volume as tmpfs mounts, which, like them, allow exec)."""
    context = spec["securityContext"]
    flags = ["--user", str(context["runAsUser"]), "--cap-drop", "ALL"]
    for capability in context["capabilities"].get("add", []):
        flags += ["--cap-add", capability]
    if context["allowPrivilegeEscalation"] is False:
        flags += ["--security-opt", "no-new-privileges"]
    if context["seccompProfile"]["type"] == "Unconfined":
        flags += ["--security-opt", "seccomp=unconfined"]
    if context.get("appArmorProfile", {}).get("type") == "Unconfined":
        flags += ["--security-opt", "apparmor=unconfined"]
    if context["readOnlyRootFilesystem"]:
        flags.append("--read-only")
    for mount in spec["volumeMounts"]:
        flags += ["--tmpfs", f"{mount['mountPath']}:exec"]
    return flags


@pytest.fixture(scope="module")
def cluster_image(docker_daemon: None) -> str:
    before = docker("image", "inspect", "--format", "{{.Id}}", CLUSTER_IMAGE, check=False)
    subprocess.run(
        [str(REPO / "scripts" / "image.sh"), "--cluster", CLUSTER_IMAGE],
        capture_output=True,
        timeout=1800,
        check=True,
    )
    after = docker("image", "inspect", "--format", "{{.Id}}", CLUSTER_IMAGE)
    if before.startswith("sha256:") and before != after:
        docker("image", "rm", before, check=False)
    return CLUSTER_IMAGE


class Pods:
    """The head and one worker of the RayCluster, as containers on a network of their own."""

    def __init__(self, image: str, head: Any, worker: Any, stand_ins: Path) -> None:
        suffix = os.urandom(4).hex()
        self.network = f"cloche-test-ray-{suffix}"
        self.head = f"cloche-test-head-{suffix}"
        self.worker = f"cloche-test-worker-{suffix}"
        self.image = image
        self.ray_token = os.urandom(16).hex()
        (stand_ins / "cloche").write_text(FRONT_END_STAND_IN)
        (stand_ins / "cloche").chmod(0o755)
        docker("network", "create", self.network)
        self.run(
            self.head,
            head,
            "head",
            ["-v", f"{stand_ins}:/stand-ins:ro", "-e", f"PATH=/stand-ins:{PATH_IN_IMAGE}"],
            "127.0.0.1:6379",
        )
        self.run(self.worker, worker, "worker", [], f"{self.head}:6379")

    def run(self, name: str, group: Any, node_type: str, extra: list[str], ray: str) -> None:
        spec = container(group)
        params = {**group, "rayStartParams": dict(group["rayStartParams"])}
        if node_type == "worker":
            params["rayStartParams"]["address"] = ray
        env = {
            "RAY_ADDRESS": ray,  # what KubeRay sets
            "RAY_AUTH_MODE": "token",  # authOptions
            "RAY_AUTH_TOKEN": self.ray_token,
            "KUBERAY_GEN_RAY_START_CMD": generated_ray_start(params, node_type),
            "CLOCHE_TOKEN": "test-token",  # the Secret
        }
        env.update({item["name"]: item["value"] for item in spec["env"] if "value" in item})
        flags = [f"--env={key}={value}" for key, value in env.items()]
        docker(
            "run", "-d", "--name", name, "--hostname", name, "--network", self.network,
            "--shm-size", "1g", *docker_flags(spec), *flags, *extra,
            "--entrypoint", spec["command"][0], self.image, *spec["command"][1:], *spec["args"],
        )  # fmt: skip

    def python(self, code: str, timeout_s: float = 300.0) -> Any:
        """Runs code on the head (Ray's address and token in its environment); its JSON line."""
        return json.loads(docker("exec", self.head, "python", "-c", code, timeout_s=timeout_s))

    def remove(self) -> None:
        docker("rm", "--force", self.head, self.worker, check=False)
        docker("network", "rm", self.network, check=False)


@pytest.fixture
def pods(cluster_image: str, head: Any, worker: Any, tmp_path: Path) -> Iterator[Pods]:
    started = Pods(cluster_image, head, worker, tmp_path)
    try:
        yield started
    finally:
        started.remove()


def worker_node(pods: Pods) -> dict[str, float]:
    deadline = time.monotonic() + 120
    while True:
        nodes = pods.python(NODES)
        found = [node for node in nodes if "cloche_node" in node]
        if found:
            (node,) = found
            return {**node, "nodes": len(nodes)}
        assert time.monotonic() < deadline, f"no worker joined: {nodes}"
        time.sleep(1)  # polling for the worker's raylet, with a deadline


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_pods_form_a_ray_cluster_and_an_agent_runs_sandboxes_on_the_worker(
    pods, worker
) -> None:
    node = worker_node(pods)
    assert node["cloche_node"] == 1 and node["nodes"] == 2  # the head offers none
    raylet = int(worker["rayStartParams"]["node-manager-port"])  # what the probes ask
    probe = f"import socket; socket.create_connection(('127.0.0.1', {raylet}), 5)"
    docker("exec", pods.worker, "python", "-c", probe)
    answer = pods.python(AGENT.replace("PORT", str(AGENT_PORT)))
    assert answer["cells"][0] == "2\n"
    assert "Linux version 4.4.0" in answer["cells"][1]  # gVisor's kernel, inside the worker pod
    assert answer["stopped"] == 0


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_head_stops_its_front_end_then_ray_on_sigterm(pods) -> None:
    worker_node(pods)
    docker("stop", "--time", "60", pods.head, timeout_s=120)
    assert docker("inspect", "--format", "{{.State.ExitCode}}", pods.head) == "0"
    logs = subprocess.run(
        ["docker", "logs", pods.head], capture_output=True, text=True, timeout=60, check=False
    )
    assert "front end stand-in: joined Ray" in logs.stdout + logs.stderr


def test_a_leaving_worker_drains_its_node_within_kubernetes_grace(worker) -> None:
    """The preStop asks the front end to drain this node (by its pod IP) with the admin's
    token from a file the agent's environment does not carry, within the pod's grace."""
    spec = worker["template"]["spec"]
    box = container(worker)
    assert spec["terminationGracePeriodSeconds"] == 30
    command = " ".join(box["lifecycle"]["preStop"]["exec"]["command"])
    assert "cloche nodes leave --url http://cloche:8080 --grace 25" in command
    assert "/etc/cloche/admin-token" in command
    env = {item["name"]: item for item in box["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "CLOCHE_ADMIN_TOKEN" not in env and "CLOCHE_TOKEN" not in env
    mounts = {m["name"]: m for m in box["volumeMounts"]}
    assert mounts["admin-token"]["mountPath"] == "/etc/cloche" and mounts["admin-token"]["readOnly"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["admin-token"]["secret"]["items"] == [
        {"key": "admin-token", "path": "admin-token"}
    ]
