"""Sessions of templates built from real images, end to end through the HTTP API and real
gVisor: a Debian tarball made by mmdebstrap and a `docker save` archive of it run cells on
the image's own python3 (its packages import) and commands on its bash; an image without
python3 runs cells on cloche's interpreter, C extension modules included; a setuid binary of
the image gains nothing, while the same file on the host does."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloche.config import Limits
from cloche.sandbox import gvisor
from cloche.sandbox.interpreter import FOREIGN_PYTHON
from dockerd import docker
from images_support import IMAGE_MARKER, SETUID_ID
from support import ServerThread, make_config, require_gvisor

pytestmark = [
    pytest.mark.timeout(1200),
    pytest.mark.skipif(os.geteuid() != 0, reason="building templates needs root (chroot)"),
]
ADMIN = "admin-token"
# Generous: the first import of an interpreter's modules through gVisor's file server on a
# machine shared by many is slow (seconds), never the point of these tests.
LIMITS = Limits(cell_timeout_s=120.0, interrupt_grace_s=2.0)
HOST_PYTHON = (
    Path(sys.base_exec_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
)


@pytest.fixture(scope="module")
def server(state_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    require_gvisor()
    config = make_config(
        state_root,
        pool_size=1,
        admin_tokens=frozenset({ADMIN}),
        templates_dir=tmp_path_factory.mktemp("templates"),
        limits=LIMITS,
    )
    with ServerThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    base = f"http://127.0.0.1:{server.http_port}"
    headers = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=base, headers=headers, timeout=300) as client:
        yield client


def build(http: httpx.Client, name: str, **source: str) -> dict[str, Any]:
    """Build a template from source (from_tar=PATH or from_image=REF) and wait for its end."""
    started = http.post("/v1/templates", json={"name": name, **source})
    assert started.status_code == 202, started.text
    deadline = time.monotonic() + 900
    while (info := http.get(f"/v1/templates/{name}").json())["state"] == "building":
        assert time.monotonic() < deadline, info
        time.sleep(0.2)  # polling a build, with a deadline
    assert info["state"] == "ready", info
    return dict(info)


@pytest.fixture(scope="module")
def debian(http: httpx.Client, debian_tar: Path) -> Iterator[dict[str, Any]]:
    yield build(http, "debian", from_tar=str(debian_tar))
    http.delete("/v1/templates/debian")


@pytest.fixture(scope="module")
def without_python(http: httpx.Client, debian_tar_without_python: Path) -> Iterator[dict[str, Any]]:
    yield build(http, "nopython", from_tar=str(debian_tar_without_python))
    http.delete("/v1/templates/nopython")


class Session:
    """A session of one template, driven through the HTTP API."""

    def __init__(self, http: httpx.Client, template: str) -> None:
        self.http = http
        created = http.post("/v1/sessions", json={"template": template})
        assert created.status_code == 201, created.text
        assert created.json()["template"] == template
        self.id = str(created.json()["id"])

    def cell(self, code: str) -> dict[str, Any]:
        done = self.http.post(f"/v1/sessions/{self.id}/execute", json={"code": code})
        assert done.status_code == 200, done.text
        body: dict[str, Any] = done.json()
        assert body["status"] == "ok", body
        return body

    def sh(self, cmd: str, user: str | None = None) -> dict[str, Any]:
        request: dict[str, Any] = {"cmd": cmd, "timeout": 120}
        if user is not None:
            request["user"] = user
        done = self.http.post(f"/v1/sessions/{self.id}/commands", json=request)
        assert done.status_code == 200, done.text
        return dict(done.json())

    def close(self) -> None:
        self.http.delete(f"/v1/sessions/{self.id}")


@pytest.fixture
def session_of(http: httpx.Client) -> Iterator[Any]:
    made: list[Session] = []

    def make(template: str) -> Session:
        made.append(Session(http, template))
        return made[-1]

    yield make
    for session in made:
        session.close()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rootfs_of(server: ServerThread, name: str) -> Path:
    return Path(server.config.templates_root) / name / "rootfs"


def assert_runs_on_the_images_python_and_bash(
    server: ServerThread, session: Session, template: str
) -> None:
    cell = session.cell(
        "import sys, yaml, getpass\n"
        "print(sys.executable, yaml.__file__, getpass.getuser(), sep='\\n')\n"
        "yaml.safe_load('a: [1, 2]')"
    )
    assert cell["stdout"].splitlines() == [
        "/usr/bin/python3.11",
        "/usr/lib/python3/dist-packages/yaml/__init__.py",
        "user",
    ]
    assert cell["result_json"] == {"a": [1, 2]}
    shell = session.sh(f"echo $BASH_VERSION; cat {IMAGE_MARKER}; sha256sum /bin/bash; id -un")
    version, marker, digest, user = shell["stdout"].splitlines()
    assert shell["exit_code"] == 0 and version.startswith("5.")
    assert marker == "debian"
    assert digest.split()[0] == sha256(rootfs_of(server, template) / "usr/bin/bash")
    assert user == "user"
    assert session.sh("id -u", user="root")["stdout"] == "0\n"


def test_a_debian_tarball_runs_cells_on_its_python_and_commands_on_its_bash(
    server, debian, session_of
):
    assert (debian["python"], debian["shell"]) == ("/usr/bin/python3.11", "/bin/bash")
    assert_runs_on_the_images_python_and_bash(server, session_of("debian"), "debian")
    # The package is the image's alone: cloche's own interpreter has no yaml.
    plain = session_of("python").cell(
        "try:\n    import yaml\nexcept ImportError as exc:\n    print(type(exc).__name__)"
    )
    assert plain["stdout"] == "ModuleNotFoundError\n"


@pytest.mark.docker
def test_a_docker_save_archive_of_it_runs_the_same(
    server, http, docker_daemon, debian_tar, tmp_path, session_of
):
    name = f"cloche-test-template:{uuid.uuid4().hex[:8]}"
    docker("import", str(debian_tar), name, timeout_s=300)
    try:
        archive = tmp_path / "saved.tar"
        docker("save", "--output", str(archive), name, timeout_s=300)
    finally:
        docker("image", "rm", "--force", name, check=False)
    info = build(http, "saved", from_image=f"docker-archive:{archive}")
    session = Session(http, "saved")
    try:
        assert info["python"] == "/usr/bin/python3.11"
        assert_runs_on_the_images_python_and_bash(server, session, "saved")
    finally:
        session.close()
        http.delete("/v1/templates/saved")


def test_an_image_without_python3_runs_cells_on_cloches_interpreter(
    server, without_python, session_of
):
    assert (without_python["python"], without_python["shell"]) == (None, "/bin/bash")
    session = session_of("nopython")
    assert session.sh("command -v python3 python3.11; echo $?")["stdout"] == "1\n"
    inside = Path(FOREIGN_PYTHON) / HOST_PYTHON.relative_to(Path(sys.base_prefix).resolve())
    # C extension modules: of the interpreter's own (linked to the host's libssl, sqlite,
    # libffi) and of cloche's runtime; the exact build: a libpython of the same X.Y from
    # the host's library directory would load too, and _ssl would then fail.
    cell = session.cell(
        "import sys, ssl, sqlite3, ctypes, decimal\n"
        "print(sys.executable, sys.version, ssl.OPENSSL_VERSION, sep='\\n')\n"
        "print(sqlite3.connect(':memory:').execute('select 6 * 7').fetchone()[0])\n"
        "print(ctypes.CDLL(None).getpid() == __import__('os').getpid())\n"
        "try:\n    import yaml\nexcept ImportError as exc:\n    print(type(exc).__name__)"
    )
    import ssl

    assert cell["stdout"].splitlines() == [
        str(inside),
        sys.version,
        ssl.OPENSSL_VERSION,
        "42",
        "True",
        "ModuleNotFoundError",
    ]
    runtime = server.config.runtime_dir
    if runtime is not None and (runtime / "numpy").is_dir():
        numpy = session.cell("import numpy\nint(numpy.arange(10).sum())")
        assert numpy["result_json"] == 45
    shell = session.sh(f"cat {IMAGE_MARKER}; sha256sum /bin/bash")
    marker, digest = shell["stdout"].splitlines()
    assert marker == "debian-without-python"
    assert digest.split()[0] == sha256(rootfs_of(server, "nopython") / "usr/bin/bash")


def test_a_setuid_binary_of_the_image_gains_nothing(server, without_python, session_of):
    session = session_of("nopython")
    seen = session.sh(f"stat -c '%a %u' {SETUID_ID} /usr/bin/su /usr/bin/passwd")
    assert seen["stdout"].split("\n")[:3] == ["4755 0", "4755 0", "4755 0"]
    assert session.sh(f"{SETUID_ID} -u; {SETUID_ID} -un")["stdout"] == "1000\nuser\n"
    su = session.sh("su -c 'id -u' root < /dev/null; echo status=$?")
    assert "status=1" in su["stdout"] and "\n0\n" not in "\n" + su["stdout"]
    passwd = session.sh("printf 'x\\nx\\nx\\n' | passwd; echo status=$?")
    assert "status=0" not in passwd["stdout"]
    assert "password updated" not in passwd["stdout"] + passwd["stderr"]
    # Root inside makes one in the session's layer: as inert.
    made = session.sh(
        "cp /usr/bin/id /usr/local/bin/mine && chmod 4755 /usr/local/bin/mine", user="root"
    )
    assert made["exit_code"] == 0, made
    assert session.sh("/usr/local/bin/mine -u")["stdout"] == "1000\n"
    cell = session.cell("import os\nlist(os.getresuid())")
    assert cell["result_json"] == [1000, 1000, 1000]
    # The probe can tell: the image's file, run the same way on the host, becomes root.
    with tempfile.TemporaryDirectory(prefix="cloche-setuid-") as directory:
        os.chmod(directory, 0o755)  # noqa: S103  # for uid 1000 to reach the copy
        copy = Path(directory) / "rootid"
        shutil.copy2(rootfs_of(server, "nopython") / SETUID_ID.lstrip("/"), copy)
        os.chown(copy, 0, 0)
        os.chmod(copy, 0o4755)  # noqa: S103  # the point: a setuid-root file
        host = subprocess.run(
            ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", str(copy), "-u"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    assert host.stdout == "0\n", host


def test_a_session_started_on_ptrace_is_restored_on_ptrace_and_runs_commands(
    server, http, without_python, session_of, monkeypatch
):
    """`--platform auto` starts sandboxes beyond 2 per core on ptrace (here: all of them);
    a pause's image is restored on the platform that made it. Restored on systrap, such a
    session wedged about half the time (its supervisor spinning in the sentry's brk, or a
    command never ending: benchmarks/image_pause_wedge.py)."""
    backend = server.server.manager.backend
    assert backend._ptrace_when_busy, "the test's server runs --platform auto on systrap"
    monkeypatch.setattr(gvisor, "PTRACE_FROM_PER_CORE", 0)
    session = session_of("nopython")
    if platform_asked(server, session) != ("run", "ptrace"):  # warm before: the next isn't
        session = session_of("nopython")
    assert platform_asked(server, session) == ("run", "ptrace")
    assert session.sh("echo kept > /home/user/note", user="root")["exit_code"] == 0
    for _ in range(4):
        assert http.post(f"/v1/sessions/{session.id}/pause").status_code == 200
        done = session.sh("cat /home/user/note; id -u", user="root")
        assert (done["stdout"], done["exit_code"], done["end_reason"]) == ("kept\n0\n", 0, "ok")
        assert platform_asked(server, session) == ("restore", "ptrace")


def platform_asked(server: ServerThread, session: Session) -> tuple[str, str]:
    """How runsc was asked to start a session's sandbox (run or restore) and on what."""
    kernel = server.server.manager._sessions[session.id].kernel
    args = [str(arg) for arg in kernel.sandbox.process.args]
    verb = "restore" if "restore" in args else "run"
    (platform,) = (arg.removeprefix("--platform=") for arg in args if arg.startswith("--platform="))
    return verb, platform
