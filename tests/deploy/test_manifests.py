"""compose.yaml and deploy/kubernetes/ agree with the server's defaults and the image's needs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from cloche.config import ServerConfig
from support import REPO

DEFAULTS = ServerConfig()
KUBERNETES = REPO / "deploy" / "kubernetes"
DATA_DIR = "/var/lib/cloche"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def dockerfile_volume() -> str:
    match = re.search(r"^VOLUME (\S+)$", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    assert match
    return match[1]


def test_the_image_s_volume_is_the_data_dir() -> None:
    assert dockerfile_volume() == DATA_DIR
    assert f"CLOCHE_DATA_DIR={DATA_DIR}" in (REPO / "Dockerfile").read_text()


# compose.yaml


@pytest.fixture(scope="module")
def compose() -> Any:
    return load(REPO / "compose.yaml")


def test_compose_publishes_the_server_s_default_ports_on_loopback(compose) -> None:
    cloche = compose["services"]["cloche"]
    assert sorted(cloche["ports"]) == sorted(
        f"127.0.0.1:{port}:{port}" for port in (DEFAULTS.tcp_port, DEFAULTS.http_port)
    )
    assert cloche["environment"]["CLOCHE_HOST"] == "0.0.0.0"


def test_compose_keeps_cloche_s_data_on_a_named_volume(compose) -> None:
    volume, path = compose["services"]["cloche"]["volumes"][0].split(":")
    assert path == DATA_DIR
    assert volume in compose["volumes"]


def test_compose_gives_runsc_what_it_needs(compose) -> None:
    cloche = compose["services"]["cloche"]
    assert cloche["cap_add"] == ["SYS_ADMIN"]
    seccomp, apparmor = cloche["security_opt"]
    assert (REPO / seccomp.removeprefix("seccomp=")).is_file()
    assert apparmor == "apparmor=unconfined"  # AppArmor's docker-default denies mount


def test_compose_s_prometheus_scrapes_cloche_s_metrics(compose) -> None:
    prometheus = compose["services"]["prometheus"]
    context = REPO / prometheus["build"]["context"]
    assert (context / "Dockerfile").is_file()
    config = load(context / "prometheus.yml")
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"cloche:{DEFAULTS.http_port}"]


# deploy/kubernetes


@pytest.fixture(scope="module")
def manifests() -> dict[str, Any]:
    kustomization = load(KUBERNETES / "kustomization.yaml")
    found = [load(KUBERNETES / name) for name in kustomization["resources"]]
    return {manifest["kind"]: manifest for manifest in found}


@pytest.fixture(scope="module")
def pod(manifests) -> Any:
    return manifests["StatefulSet"]["spec"]["template"]


@pytest.fixture(scope="module")
def container(pod) -> Any:
    (only,) = pod["spec"]["containers"]
    return only


def test_the_service_exposes_tcp_8000_and_http_8080(manifests, container) -> None:
    service_ports = {p["name"]: p["port"] for p in manifests["Service"]["spec"]["ports"]}
    assert service_ports == {"repl": DEFAULTS.tcp_port, "http": DEFAULTS.http_port}
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container_ports == service_ports
    selector = manifests["Service"]["spec"]["selector"]
    assert (
        selector.items()
        <= manifests["StatefulSet"]["spec"]["template"]["metadata"]["labels"].items()
    )


def test_probes_hit_health_on_the_http_port(container) -> None:
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}


def test_prometheus_annotations_point_at_metrics(pod) -> None:
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(DEFAULTS.http_port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_security_context_is_what_runsc_needs_and_no_more(pod, container) -> None:
    assert "runtimeClassName" not in pod["spec"]  # runsc can't run inside gVisor
    context = container["securityContext"]
    assert context["runAsUser"] == 0
    assert "privileged" not in context
    assert context["capabilities"]["drop"] == ["ALL"]
    added = set(context["capabilities"]["add"])
    assert "SYS_ADMIN" in added
    assert not added & {"NET_RAW", "NET_ADMIN", "SYS_PTRACE", "SYS_MODULE", "MKNOD"}
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["seccompProfile"]["type"] in ("Unconfined", "Localhost")
    # AppArmor's default profile for containers (on nodes that have AppArmor) denies mount.
    assert context["appArmorProfile"]["type"] == "Unconfined"
    writable = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert {"/run", "/tmp", DATA_DIR} <= writable  # runsc's state, temp files, the data


def test_the_data_dir_is_a_stable_volume(manifests, container) -> None:
    (claim,) = manifests["StatefulSet"]["spec"]["volumeClaimTemplates"]
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == dockerfile_volume()


def test_tokens_and_the_llm_key_come_from_a_secret(container) -> None:
    env = {item["name"]: item for item in container["env"]}
    assert env["CLOCHE_HOST"]["value"] == "0.0.0.0"
    names = ("CLOCHE_TOKEN", "CLOCHE_ADMIN_TOKEN", "CLOCHE_LLM_API_KEY")
    for name in names:
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "cloche"
    secret = load(KUBERNETES / "secret.example.yaml")
    assert set(secret["stringData"]) == {
        env[name]["valueFrom"]["secretKeyRef"]["key"] for name in names
    }


def test_resources_are_requested_and_memory_is_bounded(container) -> None:
    resources = container["resources"]
    assert {"cpu", "memory"} <= resources["requests"].keys()
    assert "memory" in resources["limits"]


def test_the_network_policy_lets_in_only_the_front_ends_ports(manifests) -> None:
    policy = manifests["NetworkPolicy"]["spec"]
    assert "Ingress" in policy["policyTypes"]
    ports = {(p["port"], p["protocol"]) for rule in policy["ingress"] for p in rule["ports"]}
    assert ports == {(DEFAULTS.tcp_port, "TCP"), (DEFAULTS.http_port, "TCP")}
    assert policy["podSelector"]["matchLabels"] == manifests["Service"]["spec"]["selector"]
