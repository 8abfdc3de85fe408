"""Attacks through volumes: a session plants symlinks for the host to follow, paths try to
climb out of a volume, a read-only mount is written, a mount path covers the sandbox's own
directories. The host never follows a link made inside; nothing leaves the volume."""

from __future__ import annotations

import http.client
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import ServerThread

pytestmark = pytest.mark.timeout(600)
HOST_PASSWD = Path("/etc/passwd").read_text()
# An account only the host has (the sandbox's /etc/passwd has root, user and nobody).
HOST_ONLY = next(
    line for line in HOST_PASSWD.splitlines() if line.split(":")[0] not in ("root", "nobody")
)


class Planted:
    """A volume and a session that mounts it at /mnt/v, for one attack."""

    def __init__(self, server: ServerThread, read_only: bool = False) -> None:
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=300)
        self.name = f"attack-{uuid.uuid4().hex[:8]}"
        made = self.http.post("/v1/volumes", json={"name": self.name, "size_mib": 8})
        assert made.status_code == 201, made.text
        self.writer = self._session("/mnt/v", False)
        self.reader = self._session("/mnt/r", True) if read_only else None
        self.base = f"/v1/volumes/{self.name}/files"

    def _session(self, path: str, read_only: bool) -> str:
        mount = {"name": self.name, "path": path, "read_only": read_only}
        made = self.http.post("/v1/sessions", json={"volumes": [mount]})
        assert made.status_code == 201, made.text
        return str(made.json()["id"])

    def cell(self, code: str, session_id: str | None = None) -> Any:
        done = self.http.post(
            f"/v1/sessions/{session_id or self.writer}/execute", json={"code": code}
        )
        assert done.status_code == 200 and done.json()["status"] == "ok", done.text
        return done.json()["result_json"]

    def root_command(self, cmd: str, session_id: str) -> dict[str, Any]:
        done = self.http.post(
            f"/v1/sessions/{session_id}/commands", json={"cmd": cmd, "user": "root"}
        )
        assert done.status_code == 200, done.text
        result: dict[str, Any] = done.json()
        return result

    def raw(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """A request whose path goes out exactly as written (no client normalises it)."""
        host, port = self.http.base_url.host, self.http.base_url.port
        connection = http.client.HTTPConnection(host, port, timeout=300)
        try:
            connection.request(method, path, body=body)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def close(self) -> None:
        for session_id in (self.writer, self.reader):
            if session_id is not None:
                self.http.delete(f"/v1/sessions/{session_id}")
        self.http.delete(f"/v1/volumes/{self.name}")
        self.http.close()


@pytest.fixture
def planted(secure_server: ServerThread) -> Iterator[Planted]:
    made = Planted(secure_server)
    yield made
    made.close()


def test_cant_read_host_passwd_through_a_symlink_in_a_volume(planted: Planted) -> None:
    """Plant links to the host's /etc/passwd, /etc and / in a volume, then read them through
    the volumes files API. Outcome: refused as symlinks; no byte of the host's file comes
    back; the listing shows no link."""
    planted.cell(
        "import os\n"
        "os.symlink('/etc/passwd', '/mnt/v/passwd')\n"
        "os.symlink('/etc', '/mnt/v/etc')\n"
        "os.symlink('/', '/mnt/v/root')\n"
        "os.makedirs('/mnt/v/d'); os.symlink('../../../../../etc/passwd', '/mnt/v/d/up'); 0"
    )
    for path in ("passwd", "etc/passwd", "root/etc/passwd", "d/up", "etc/shadow"):
        response = planted.http.get(f"{planted.base}/{path}")
        assert response.status_code in (400, 404), (path, response.status_code)
        assert HOST_ONLY.encode() not in response.content
        assert b"daemon:" not in response.content
    refused = planted.http.get(f"{planted.base}/passwd").json()["error"]["message"]
    assert "symlink" in refused and "never followed" in refused
    assert planted.http.get(planted.base).json()["files"] == []


def test_cant_write_or_delete_through_a_symlink_in_a_volume(
    planted: Planted, tmp_path: Path
) -> None:
    """Plant a link to a host directory and to a host file, then upload through them and
    delete them. Outcome: uploads refused, the host untouched; a delete removes the link
    itself, never what it points at."""
    target = tmp_path / "host-dir"
    target.mkdir()
    victim = tmp_path / "host-file"
    victim.write_text("the host's")
    planted.cell(
        f"import os; os.symlink({str(target)!r}, '/mnt/v/out'); "
        f"os.symlink({str(victim)!r}, '/mnt/v/file'); 0"
    )
    assert planted.http.put(f"{planted.base}/out/evil", content=b"x").status_code == 400
    assert planted.http.put(f"{planted.base}/file", content=b"x").status_code == 400
    assert list(target.iterdir()) == []
    assert victim.read_text() == "the host's"
    assert planted.http.delete(f"{planted.base}/file").status_code == 204
    assert planted.http.delete(f"{planted.base}/out/anything").status_code == 400
    assert victim.read_text() == "the host's" and target.is_dir()
    assert planted.cell("import os; sorted(os.listdir('/mnt/v'))") == ["out"]


@pytest.mark.parametrize(
    "path",
    [
        "../../../../etc/passwd",
        "..%2F..%2F..%2F..%2Fetc%2Fpasswd",
        "%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "a/../../../../../etc/passwd",
        "%2Fetc%2Fpasswd",
        "/etc/passwd",
        "./../x",
        "..",
    ],
)
def test_no_dotdot_path_leaves_a_volume(planted: Planted, path: str) -> None:
    """Climb out of a volume with `..` and absolute paths, raw and percent-encoded, to read,
    write and delete. Outcome: refused or not found, never served; nothing outside
    changes."""
    planted.http.put(f"{planted.base}/a/inside", content=b"in the volume")
    url = f"{planted.base}/{path}"
    status, body = planted.raw("GET", url)
    assert status in (400, 404), (status, body[:200])
    assert HOST_ONLY.encode() not in body
    status, _ = planted.raw("PUT", url, b"written")
    assert status in (400, 404, 405)
    status, _ = planted.raw("DELETE", url)
    assert status in (400, 404, 405)
    assert Path("/etc/passwd").read_text() == HOST_PASSWD
    assert planted.http.get(f"{planted.base}/a/inside").content == b"in the volume"
    # Nor does a name that climbs reach another directory of the host.
    status, _ = planted.raw("GET", f"/v1/volumes/..%2F..%2F{planted.name}/files/a/inside")
    assert status == 404


def test_a_read_only_volume_cant_be_written_even_as_root_inside(
    secure_server: ServerThread,
) -> None:
    """As root inside the sandbox, truncate, write and remove a file of a volume mounted
    read-only (runsc 0.0~20240729 truncates on the host a file of a read-only bind mount
    opened with O_TRUNC). Outcome: EROFS each time, the file intact."""
    planted = Planted(secure_server, read_only=True)
    try:
        assert planted.http.put(f"{planted.base}/f", content=b"intact").status_code == 204
        assert planted.reader is not None
        done = planted.root_command(
            'python3 -c "import os, errno\n'
            "def attempt(act):\n"
            "    try: act(); return 'done'\n"
            "    except OSError as e: return errno.errorcode[e.errno]\n"
            "print(attempt(lambda: os.open('/mnt/r/f', os.O_RDONLY | os.O_TRUNC)),"
            " attempt(lambda: os.open('/mnt/r/f', os.O_WRONLY | os.O_TRUNC)),"
            " attempt(lambda: os.truncate('/mnt/r/f', 0)),"
            " attempt(lambda: os.unlink('/mnt/r/f')))\"",
            planted.reader,
        )
        assert done["stdout"].split() == ["EROFS"] * 4, done
        assert planted.http.get(f"{planted.base}/f").content == b"intact"
    finally:
        planted.close()


def test_cant_reach_the_host_or_other_volumes_from_a_volume(
    planted: Planted, secure_server: ServerThread
) -> None:
    """From inside, climb out of the mounted volume, follow a link planted in it, look for
    the volumes directory. Outcome: only the sandbox's own root is there."""
    other = Planted(secure_server)
    try:
        other.http.put(f"{other.base}/other-secret", content=b"not yours")
        volumes_root = str(secure_server.config.volumes_root)
        seen = planted.cell(
            "import os\n"
            "os.symlink('/', '/mnt/v/up')\n"
            "[sorted(os.listdir('/mnt/v/..')),"
            " [l.split(':')[0] for l in open('/mnt/v/up/etc/passwd')],"
            f" os.path.exists({volumes_root!r}),"
            " any('other-secret' in files for _, _, files in os.walk('/mnt'))]"
        )
        assert seen[0] == ["v"]
        assert seen[1] == ["root", "user", "nobody"]
        assert seen[2] is False and seen[3] is False
    finally:
        other.close()


@pytest.mark.parametrize(
    "path",
    ["/opt/cloche/cloche/kernel", "/opt/cloche", "/proc/self", "/dev/shm", "/sys", "/usr", "/"],
)
def test_cant_mount_a_volume_over_the_sandboxes_own_directories(
    secure_server: ServerThread, path: str
) -> None:
    """Mount a volume over the kernel's code, /proc, /dev, /sys, /usr or the root, to replace
    what the sandbox runs. Outcome: refused before any sandbox starts."""
    with httpx.Client(base_url=f"http://127.0.0.1:{secure_server.http_port}") as client:
        name = f"cover-{uuid.uuid4().hex[:8]}"
        assert client.post("/v1/volumes", json={"name": name, "size_mib": 4}).status_code == 201
        try:
            mount = {"name": name, "path": path}
            refused = client.post("/v1/sessions", json={"volumes": [mount]}, timeout=120)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["type"] == "volume_refused"
        finally:
            client.delete(f"/v1/volumes/{name}")
