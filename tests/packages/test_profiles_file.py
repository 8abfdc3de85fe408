"""Profiles from a file: runtimes built on the host from requirements, against real runsc."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

import cloche
from cloche.config import PackageConfig
from cloche.errors import ConfigError
from cloche.packages.profiles import load
from packages.conftest import LIMITS
from support import ServerThread, make_config, require_gvisor

PROFILES = """
[profiles.tab]
requirements = ["tabulate==0.9.*", "six"]
preload = ["tabulate"]
pool = 1
memory_mib = 512

[profiles.typo]
requirement = ["six"]

[profiles.unresolvable]
requirements = ["cloche-no-such-package-3f9a1c"]
"""


def wait_listed(port: int, name: str, timeout_s: float = 240) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    while True:
        rows = httpx.get(f"http://127.0.0.1:{port}/v1/profiles").json()["profiles"]
        row = next(r for r in rows if r["name"] == name)
        if row["state"] != "building":
            return row
        assert time.monotonic() < deadline, f"profile {name} still building"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "profiles.toml"
    path.write_text(PROFILES)
    return path


def test_a_profile_may_name_its_sessions_egress_policy(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("[profiles.web]\nrequirements = ['six']\negress = 'research'\n")
    (spec,), errors = load(path, max_memory_mib=1024)
    assert errors == {} and spec.egress == "research"


def test_the_file_is_read_with_an_error_per_bad_profile(profile_file):
    specs, errors = load(profile_file, max_memory_mib=1024)
    assert [spec.name for spec in specs] == ["tab", "unresolvable"]
    assert set(errors) == {"typo"}
    assert "profile 'typo'" in errors["typo"] and "unknown key requirement" in errors["typo"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[profiles.x]\nrequirements = ['--index-url=http://evil']\n", "option of pip"),
        ("[profiles.lean]\nrequirements = ['six']\n", "built-in"),
        ("[profiles.x]\nrequirements = ['six']\npool = 99\n", "pool"),
        ("[profiles.x]\nrequirements = ['six']\nmemory_mib = 99999\n", "memory_mib"),
        ("[profiles.x]\nrequirements = ['six']\npreload = ['os; import evil']\n", "preload"),
        ("[profiles.x]\nrequirements = ['six']\negress = 3\n", "egress must be the name"),
    ],
)
def test_bad_profiles_are_named_with_their_cause(tmp_path, text, match):
    path = tmp_path / "p.toml"
    path.write_text(text)
    specs, errors = load(path, max_memory_mib=1024)
    assert specs == [] and len(errors) == 1
    assert match in next(iter(errors.values()))


def test_a_file_that_is_not_toml_is_a_config_error(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("[profiles.x\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(path, max_memory_mib=1024)


def test_a_profile_is_built_listed_pooled_and_its_sessions_import_its_packages(
    state_root, profile_file, tmp_path
):
    require_gvisor()
    cache = tmp_path / "cache"
    config = make_config(
        state_root,
        pool_size=1,
        profiles_file=profile_file,
        limits=LIMITS,
        packages=PackageConfig(cache_dir=cache),
    )
    with ServerThread(config) as server:
        port = server.http_port
        tab = wait_listed(port, "tab")
        assert tab["state"] == "ready", tab
        assert {p["name"] for p in tab["packages"]} == {"tabulate", "six"}
        typo = wait_listed(port, "typo")
        assert typo["state"] == "failed" and "unknown key requirement" in typo["error"]
        broken = wait_listed(port, "unresolvable")
        assert broken["state"] == "failed"
        assert "'unresolvable'" in broken["error"] and "no package" in broken["error"]
        server.call(server.server.manager.pools["tab"].wait_full(120), timeout_s=130)
        with cloche.Client(f"http://127.0.0.1:{port}") as client:
            with client.create_session("tab") as session:
                execution = session.run(
                    "import sys\n"
                    "print('tabulate' in sys.modules)\n"  # preloaded
                    "import tabulate, six\n"
                    "tabulate.__version__"
                )
                assert execution.error is None, execution.error
                assert execution.logs.stdout == "True\n"
                assert execution.text.startswith("'0.9")
                numpy = session.run("import numpy")  # its runtime is its own, not the server's
                assert numpy.error is not None and numpy.error.ename == "ModuleNotFoundError"
                assert session.run("%pip install -q humanize\nimport humanize").error is None
            with client.create_session("lean") as lean:
                execution = lean.run("import tabulate")
                assert execution.error is not None
                assert execution.error.ename == "ModuleNotFoundError"
            with pytest.raises(cloche.ClocheError, match="unknown key requirement"):
                client.create_session("typo")
            with pytest.raises(cloche.ClocheError, match="unknown profile"):
                client.create_session("nothere")
        with server.client() as tcp:  # the TCP protocol's field `profile`
            reply = tcp.request({"code": "import tabulate; 'ok'", "profile": "tab"})
            assert reply["status"] == "ok", reply
        built = server.server.manager.catalog.statuses["tab"].build_s

    # A restart finds the runtime without rebuilding, even with the index unreachable.
    config = make_config(
        state_root,
        pool_size=1,
        profiles_file=profile_file,
        limits=LIMITS,
        packages=PackageConfig(cache_dir=cache, index_url="file:///nonexistent/simple"),
    )
    with ServerThread(config) as server:
        tab = wait_listed(server.http_port, "tab")
        assert tab["state"] == "ready", tab
        again = server.server.manager.catalog.statuses["tab"].build_s
        print(f"profile build: {built:.2f} s; found again after a restart: {again:.3f} s")
        with cloche.Client(f"http://127.0.0.1:{server.http_port}") as client:
            with client.create_session("tab") as session:
                assert session.run("import tabulate").error is None


async def test_a_session_of_a_profile_still_building_waits_then_gets_a_clear_503(
    tmp_path, monkeypatch
):
    """The manager's side alone (no sandbox is started): the build never ends here."""
    from cloche.errors import SandboxStartError, UnknownProfile
    from cloche.packages.profiles import ProfileCatalog, ProfileState, ProfileStatus
    from cloche.sandbox.registry import create_backend
    from cloche.sessions import local, pools

    config = make_config(tmp_path, backend="unsafe-local", pool_size=0)
    manager = local.LocalSessionManager(config, create_backend(config))
    catalog = ProfileCatalog([], {"bad": "profile 'bad': unknown key x"}, None, print)  # type: ignore[arg-type]
    catalog.statuses["slow"] = ProfileStatus("slow", ProfileState.BUILDING)
    manager.catalog = catalog
    monkeypatch.setattr(pools, "PROFILE_WAIT_S", 0.2)
    with pytest.raises(SandboxStartError, match="'slow' is still building"):
        await manager.create(None, "slow")
    with pytest.raises(UnknownProfile, match="unknown key x"):
        await manager.create(None, "bad")
    with pytest.raises(UnknownProfile, match="unknown profile"):
        await manager.create(None, "nothere")
