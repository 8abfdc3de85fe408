"""What code inside a session sees: gVisor, an unprivileged user, nothing of the host."""

from __future__ import annotations

import os
import platform

import pytest

CANARY = "cloche-canary-7f1d2c9e"


@pytest.fixture(scope="module", autouse=True)
def canary_in_server_env():
    """A secret in the server's own environment (set before the module's server starts)."""
    os.environ["CLOCHE_TEST_SECRET"] = CANARY
    yield
    del os.environ["CLOCHE_TEST_SECRET"]


def run(client, code: str) -> str:
    reply = client.run(code)
    assert reply["status"] == "ok", reply
    return reply["output"]


def test_code_runs_under_gvisor_not_the_host_kernel(client):
    inside = run(client, "import platform; platform.release()")
    assert inside.strip("'\n") != platform.release()
    # gVisor's sentry answers dmesg with its own boot messages.
    assert "gVisor" in run(
        client, "import subprocess; subprocess.run(['dmesg'], capture_output=True).stdout"
    )


def test_code_runs_as_an_unprivileged_user_without_capabilities(client):
    assert (
        run(client, "import os; os.getuid(), os.getgid(), os.geteuid()") == "(1000, 1000, 1000)\n"
    )
    status = run(client, "print(open('/proc/self/status').read())")
    cap_eff = next(line for line in status.splitlines() if line.startswith("CapEff"))
    assert cap_eff.split()[1] == "0000000000000000"


def test_host_etc_is_not_visible(client):
    passwd = run(client, "print(open('/etc/passwd').read())")
    with open("/etc/passwd") as host_passwd:
        host_users = {line.split(":")[0] for line in host_passwd} - {"root", "nobody"}
    assert "user:x:1000:1000:user:/home/user:" in passwd
    assert not any(f"\n{user}:" in "\n" + passwd for user in host_users)
    assert run(client, "import os; os.path.exists('/etc/shadow')") == "False\n"


def test_server_environment_is_not_visible(client):
    code = (
        "import os, glob\n"
        "found = [k for k, v in os.environ.items() if 'canary' in v]\n"
        "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
        "    try:\n"
        "        if b'canary' in open(path, 'rb').read(): found.append(path)\n"
        "    except OSError: pass\n"
        "found, sorted(os.environ)"
    )
    output = run(client, code)
    assert output.startswith("([], ")
    assert CANARY not in output
    assert "CLOCHE" not in output


def test_no_network_to_the_internet_or_the_servers_port(server, client):
    code = (
        "import socket\n"
        "def attempt(host, port):\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=2).close()\n"
        "        return 'connected'\n"
        "    except OSError as exc:\n"
        "        return type(exc).__name__\n"
        f"[attempt('8.8.8.8', 53), attempt('127.0.0.1', {server.tcp_port}), "
        f"attempt('127.0.0.1', {server.http_port})]"
    )
    output = run(client, code)
    assert "connected" not in output, output


def test_the_system_is_roots_and_the_home_and_tmp_are_the_users(client):
    code = (
        "import os\n"
        "def can_write(path):\n"
        "    try:\n"
        "        open(path, 'w').write('x'); return True\n"
        "    except OSError: return False\n"
        "paths = ('/x', '/usr/x', '/etc/x', '/home/user/x', '/work/y', '/tmp/x')\n"
        "[can_write(p) for p in paths], os.getcwd()"
    )
    assert run(client, code) == "([False, False, False, True, True, True], '/home/user')\n"


def test_sessions_do_not_see_each_others_files(server):
    with server.client() as a, server.client() as b:
        a.run("open('mine.txt', 'w').write('secret of a')")
        listing = b.run("import os; sorted(os.listdir('.')), os.path.exists('/work/mine.txt')")
        assert listing["output"] == "([], False)\n"


def test_files_written_inside_land_on_the_host_as_the_sandbox_uid(server):
    with server.client() as c:
        reply = c.run("open('owned.txt', 'w').write('x')")
        session = server.server.manager._sessions[reply["session_id"]]
        stat = (session.kernel.sandbox.workdir / "owned.txt").stat()
        assert (stat.st_uid, stat.st_gid) == (1000, 1000)
