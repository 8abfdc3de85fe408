"""An attack on what every sandbox is given read-only: the server's own files on the host
(the kernel's code, the runtime's packages, the interpreter). runsc 0.0~20240729 truncates
a file of a read-only bind mount when a sandbox opens it with O_TRUNC (answering EROFS, or
nothing, after the damage); the server gives sandboxes these directories through binds
that are read-only on the host itself."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from cloche.sandbox.base import KERNEL_PACKAGE_DIR
from cloche.sandbox.bundle import KERNEL_MOUNT, RUNTIME_MOUNT
from support import RUNTIME_DIR, ServerThread

pytestmark = pytest.mark.timeout(300)


def targets() -> dict[str, Path]:
    """Small files of each read-only bind, inside -> on the host."""
    found = {f"{KERNEL_MOUNT}/__init__.py": KERNEL_PACKAGE_DIR / "__init__.py"}
    installer = next(RUNTIME_DIR.glob("*.dist-info/INSTALLER"), None)
    if installer is not None:
        found[f"{RUNTIME_MOUNT}/{installer.relative_to(RUNTIME_DIR)}"] = installer
    hello = Path(sys.base_prefix).resolve() / "lib" / f"python3.{sys.version_info[1]}"
    hello = hello / "__phello__" / "__init__.py"
    if hello.is_file() and not hello.is_relative_to("/usr"):
        found[str(hello)] = hello
    return found


def test_cant_truncate_the_servers_own_files_as_root_inside(secure_server: ServerThread) -> None:
    """As root inside, open the kernel's code, a runtime package's file and the interpreter's
    own file with O_TRUNC, and truncate(2) them. Outcome: EROFS each time; the host's files
    keep every byte."""
    files = targets()
    before = {host: host.read_bytes() for host in files.values()}
    script = (
        "import os, errno, sys\n"
        "def attempt(act):\n"
        "    try: act(); return 'done'\n"
        "    except OSError as e: return errno.errorcode[e.errno]\n"
        "for p in sys.argv[1:]:\n"
        "    print(attempt(lambda: os.open(p, os.O_RDONLY | os.O_TRUNC)),"
        " attempt(lambda: os.open(p, os.O_WRONLY | os.O_TRUNC)),"
        " attempt(lambda: os.truncate(p, 0)))\n"
    )
    url = f"http://127.0.0.1:{secure_server.http_port}"
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            session_id = client.post("/v1/sessions").json()["id"]
            try:
                done = client.post(
                    f"/v1/sessions/{session_id}/commands",
                    json={"cmd": "python3", "args": ["-c", script, *files], "user": "root"},
                ).json()
            finally:
                client.delete(f"/v1/sessions/{session_id}")
        assert done["stdout"].split() == ["EROFS"] * 3 * len(files), done
    finally:
        damaged = [host for host, data in before.items() if host.read_bytes() != data]
        for host in damaged:  # never leave the machine broken, whatever the outcome
            host.write_bytes(before[host])
    assert damaged == []
