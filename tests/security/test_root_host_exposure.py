"""Attacks made as root inside the sandbox through commands, against what lies outside it:
the host's files, the template's root, another session, the server's ports and its
environment.

Each probe that could pass for the wrong reason is also run where it must succeed (on the
host, or from another session).
"""

from __future__ import annotations

import hashlib
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from root_probes import CAP_NET_RAW, capabilities, host_py, py
from support import CANARY


def test_cant_read_the_hosts_files_or_another_sessions_as_root(
    attacker, witness, secure_server, server_source
):
    """As root inside, read the host's /etc/shadow, the server's source and state directory,
    and search the sandbox for another session's files (its home, and what its root wrote to
    its system layer), by name and through /proc/1/root. Outcome: the sandbox has no
    /etc/shadow of the host, no server source or state; the other session's files are
    nowhere (they are on the host, in its own disk)."""
    mark = f"victim-{uuid.uuid4().hex[:12]}"
    victim = attacker.http.post("/v1/sessions", json={}).json()["id"]
    try:
        for cmd, user in ((f"echo secret > ~/{mark}", None), (f"touch /usr/local/{mark}", "root")):
            body = {"cmd": cmd, **({"user": user} if user else {})}
            done = attacker.http.post(f"/v1/sessions/{victim}/commands", json=body).json()
            assert done["exit_code"] == 0, done
        state = secure_server.config.state_dir
        with witness.watching():
            output = attacker.out(
                "cat /etc/shadow /proc/1/root/etc/shadow; "
                f"ls {server_source}/server/app.py {state} /proc/1/root{server_source}; "
                f"find / -xdev -name '{mark}*'; "
                f"find /home /tmp /opt /run /var /srv /mnt /root /usr/local -name '{mark}*'; "
                "echo end"
            )
        host_shadow = Path("/etc/shadow").read_text().splitlines()[0]
        assert host_shadow not in output and "root:" not in output
        lines = output.splitlines()
        for path in ("/etc/shadow", f"{server_source}/server/app.py", str(state)):
            assert [x for x in lines if path in x and "No such file" in x], (path, output)
        for path in ("/proc/1/root/etc/shadow", f"/proc/1/root{server_source}"):
            assert [x for x in lines if path in x and "Permission denied" in x], (path, output)
        assert mark not in output and output.startswith("end\n"), output
        # The probe can tell: the victim's files are there, on the host.
        found = [p.name for p in state.glob(f"*/sandboxes/*/disk/**/{mark}")]
        assert sorted(found) == [mark, mark], found
    finally:
        attacker.http.delete(f"/v1/sessions/{victim}")


def test_root_writes_inside_never_reach_the_host_or_the_template(attacker, witness, secure_server):
    """As root inside, overwrite, chmod and delete files of the system: the template's /etc
    and files of the host's /usr below the session's layer (the template python's). Outcome:
    each write succeeds inside, in the session's own layer; the host's files and the
    template's root are unchanged, and a new session sees them as they were."""
    sentinels = [Path(f"/usr/local/share/cloche-sentinel-{uuid.uuid4().hex[:12]}") for _ in "ab"]
    for sentinel in sentinels:
        sentinel.write_text("host\n")
    skeleton = secure_server.server.manager.backend.rootfs  # type: ignore[attr-defined]
    passwd_before = (skeleton / "etc/passwd").read_text()
    one, two = sentinels
    try:
        with witness.watching():
            inside = attacker.out(
                f"cat {one} && echo pwned > {one} && chmod 4755 {one} && rm {two} && "
                "echo 'evil:x:0:0::/:/bin/sh' >> /etc/passwd && touch /usr/bin/cloche-evil && "
                f"cat {one}; ls {two}; stat -c %a {one}; tail -1 /etc/passwd"
            )
        assert inside.splitlines()[:2] == ["host", "pwned"], inside
        assert "4755" in inside and "evil:x:0:0" in inside
        assert [s.read_text() for s in sentinels] == ["host\n", "host\n"]
        assert oct(one.stat().st_mode & 0o7777) == "0o644"
        assert (skeleton / "etc/passwd").read_text() == passwd_before
        assert not Path("/usr/bin/cloche-evil").exists()
        with secure_server.client() as other:
            fresh = other.run(f"open('{one}').read(), open('/etc/passwd').read().count('evil')")
        assert fresh["output"] == "('host\\n', 0)\n", fresh
    finally:
        for sentinel in sentinels:
            sentinel.unlink(missing_ok=True)


def test_cant_reach_the_servers_ports_as_root(attacker, witness, secure_server):
    """As root inside, connect to the server's TCP and HTTP ports on 127.0.0.1, localhost,
    other 127.x addresses and ::1, ask its HTTP API for /health, and open raw and packet
    sockets. Outcome: nothing answers (the sandbox's loopback is its own); raw and packet
    sockets are EPERM (root's capabilities leave out CAP_NET_RAW)."""
    tcp, http = secure_server.tcp_port, secure_server.http_port
    targets = [
        ("127.0.0.1", tcp),
        ("127.0.0.1", http),
        ("localhost", http),
        ("127.0.0.2", http),
        ("127.1.2.3", tcp),
        ("::1", http),
    ]
    probe = (
        "import urllib.request\n"
        "def connect(host, port):\n"
        "    socket.create_connection((host, port), timeout=2).close()\n"
        f"results = [attempt(connect, h, p) for h, p in {targets!r}]\n"
        "def get(url):\n"
        "    try: urllib.request.urlopen(url, timeout=2)\n"
        "    except OSError as exc: raise OSError(errno.ECONNREFUSED, str(exc)) from None\n"
        f"results.append(attempt(get, 'http://127.0.0.1:{http}/health'))\n"
        "results.append(attempt(socket.socket, socket.AF_INET, socket.SOCK_RAW, 1))\n"
        "results.append(attempt(socket.socket, socket.AF_PACKET, socket.SOCK_RAW, 0))\n"
        "print(json.dumps(results))"
    )
    with witness.watching():
        results = py(attacker, probe)
    assert "done" not in results[:7], results
    assert results[7:] == ["EPERM", "EPERM"], results
    assert not capabilities(attacker) & (1 << CAP_NET_RAW)
    # The probe can tell: from the host, the server's ports and its API answer.
    assert host_py(probe)[:3] == ["done", "done", "done"]


ENVIRONMENTS = (
    "env; for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do tr '\\0' '\\n' < $f; done; "
    "echo END-$((6*7))"
)


def test_canary_is_in_no_command_process_or_terminal(attacker, witness, secure_server):
    """Look for the server's canary secret in the environment of commands (as the user and as
    root), in every /proc/*/environ and cmdline read as root, and in a terminal's shell.
    Outcome: it is nowhere; nor is any CLOCHE_ variable but the kernel's own start-up
    one."""
    url = f"ws://127.0.0.1:{secure_server.http_port}/v1/sessions/{attacker.session_id}/pty"
    with witness.watching():
        as_user = attacker.out(ENVIRONMENTS, user=None)
        as_root = attacker.out(ENVIRONMENTS)
        seen = b""
        with connect(url, open_timeout=60) as terminal:
            terminal.send(ENVIRONMENTS.encode() + b"\r")
            deadline = time.monotonic() + 60
            while b"END-42" not in seen:
                assert time.monotonic() < deadline, seen[-2000:]
                frame = terminal.recv(timeout=deadline - time.monotonic())
                seen += frame if isinstance(frame, bytes) else b""
    for output in (as_user, as_root, seen.decode(errors="replace")):
        assert "END-42" in output
        assert CANARY not in output and "CLOCHE_SECURITY_CANARY" not in output
        names = {line.split("=", 1)[0] for line in output.splitlines() if "=" in line}
        assert {n for n in names if n.startswith("CLOCHE")} <= {"CLOCHE_USER"}, names
    # The probe can tell: a process of the host with the server's environment shows it.
    host = subprocess.run(
        ["bash", "-c", ENVIRONMENTS.replace("/proc/[0-9]*/", "/proc/self/")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert CANARY in host.stdout


@pytest.mark.timeout(1200)  # it builds a template from an image first (minutes, loaded)
def test_root_writes_never_reach_an_images_root_and_its_links_lead_nowhere_on_the_host(
    secure_server, witness, debian_tar_without_python
):
    """In a session of a template built from a Debian image, as root inside: append a uid-0
    account to /etc/passwd, replace /usr/bin/id, make /usr/bin/env setuid, delete su, and
    leave links to /etc/shadow in the home and the system layer; pause and resume (the host
    saves and lays out the layer) and download the link through the files API. Outcome: the
    template's root on the host is unchanged and a new session of it sees the image as it
    was; the host never follows a link of the session (the download is refused, the links
    lead to the image's own /etc/shadow inside)."""
    with httpx.Client(base_url=f"http://127.0.0.1:{secure_server.http_port}", timeout=300) as http:
        name = f"image{uuid.uuid4().hex[:6]}"
        started = http.post(
            "/v1/templates", json={"name": name, "from_tar": str(debian_tar_without_python)}
        )
        assert started.status_code == 202, started.text
        deadline = time.monotonic() + 900
        while (info := http.get(f"/v1/templates/{name}").json())["state"] == "building":
            assert time.monotonic() < deadline, info
            time.sleep(0.2)  # polling a build, with a deadline
        assert info["state"] == "ready", info
        rootfs = secure_server.config.templates_root / name / "rootfs"
        before = {p: digest(rootfs / p) for p in ("etc/passwd", "usr/bin/id", "usr/bin/su")}
        env_mode = (rootfs / "usr/bin/env").stat().st_mode
        sessions: list[str] = []
        try:
            session = new_session(http, name, sessions)
            with witness.watching():
                done = command(
                    http,
                    session,
                    "echo 'evil:x:0:0::/:/bin/sh' >> /etc/passwd && cp /usr/bin/true /usr/bin/id "
                    "&& chmod 4755 /usr/bin/env && rm /usr/bin/su "
                    "&& ln -s /etc/shadow /home/user/shadow-link "
                    "&& ln -s /etc/shadow /usr/local/share/shadow-link && ln -s / /root/host-root",
                    user="root",
                )
                assert done["exit_code"] == 0, done
                # The host saves the layer (pause) and lays it out again (the command
                # resumes the session): it follows none of the links, and what root wrote
                # is still there, inside only.
                assert http.post(f"/v1/sessions/{session}/pause").status_code == 200
                inside = command(
                    http,
                    session,
                    "tail -1 /etc/passwd; id -u; ls /usr/bin/su; "  # id is `true` now
                    "head -c 5 /usr/local/share/shadow-link; echo; ls /root/host-root/",
                    user="root",
                )
                downloaded = http.get(f"/v1/sessions/{session}/files/shadow-link")
            lines = inside["stdout"].splitlines()
            assert lines[:2] == ["evil:x:0:0::/:/bin/sh", "root:"], inside
            assert "home" in lines[2:] and "work" in lines[2:], inside  # its own root
            assert "No such file" in inside["stderr"]
            assert downloaded.status_code != 200, downloaded.text[:200]
            host_shadow = Path("/etc/shadow").read_text()
            assert host_shadow.splitlines()[0] not in downloaded.text
            assert {p: digest(rootfs / p) for p in before} == before
            assert (rootfs / "usr/bin/env").stat().st_mode == env_mode
            assert not (rootfs / "usr/local/share/shadow-link").is_symlink()
            fresh = new_session(http, name, sessions)
            seen = command(http, fresh, "grep -c evil /etc/passwd; ls /usr/bin/su; id -u")
            assert seen["stdout"] == "0\n/usr/bin/su\n1000\n", seen
        finally:
            for each in sessions:
                http.delete(f"/v1/sessions/{each}")
            http.delete(f"/v1/templates/{name}")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def new_session(http: httpx.Client, template: str, made: list[str]) -> str:
    created = http.post("/v1/sessions", json={"template": template})
    assert created.status_code == 201, created.text
    made.append(str(created.json()["id"]))
    return made[-1]


def command(http: httpx.Client, session: str, cmd: str, user: str | None = None) -> dict:
    body: dict[str, object] = {"cmd": cmd, "timeout": 120}
    if user is not None:
        body["user"] = user
    done = http.post(f"/v1/sessions/{session}/commands", json=body)
    assert done.status_code == 200, done.text
    return dict(done.json())
