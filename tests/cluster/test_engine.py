"""Bad --cluster settings are told at once, clearly, before anything starts."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from cloche.cluster.engine import Engine, _workers_of
from cloche.errors import ConfigError
from support import make_config, require_cluster


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("local:x", "local:N takes 1 to 16 nodes"),
        ("local:0", "local:N takes 1 to 16 nodes"),
        ("local:99", "local:N takes 1 to 16 nodes"),
        ("nonsense", "must be local:N, auto or HOST:PORT"),
        ("ray://127.0.0.1:10001", r"Ray Client\) is not supported: a front end sends cells"),
        ("127.0.0.1:1", "no Ray cluster answers at 127.0.0.1:1"),
    ],
)
def test_a_bad_cluster_setting_is_refused_with_what_to_give(
    tmp_path: Path, spec: str, message: str
) -> None:
    require_cluster()
    engine = Engine(make_config(tmp_path, cluster=spec))
    with pytest.raises(ConfigError, match=message):
        engine.open()
    assert not engine.local


def test_a_local_cluster_s_stop_finds_its_ray_workers_and_only_them(tmp_path: Path) -> None:
    """Ray titles its workers "ray::<class>", naming nothing of ours on their command lines;
    an agent declared dead still there as the cluster stops is one, found by the cluster's
    RAY_TMPDIR in its environment (stand-ins: `sleep` under such titles)."""
    ours, other = str(tmp_path / "ray-ours"), str(tmp_path / "ray-other")

    def start(title: str, temp: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            ["bash", "-c", f"exec -a '{title}' sleep 600"], env={"RAY_TMPDIR": temp}
        )

    started = [
        start("ray::NodeAgent", ours),
        start("ray::NodeAgent", other),  # another cluster's
        start("python", ours),  # a process that inherited the variable: not a worker
    ]
    try:
        deadline = time.monotonic() + 30
        while _workers_of(ours) != [started[0].pid]:  # each exec'd its title by then
            assert time.monotonic() < deadline, _workers_of(ours)
            time.sleep(0.02)
    finally:
        for process in started:
            process.kill()
            process.wait(30)
    assert _workers_of(ours) == []
