"""Attacks that try to see the host, the server, or another session."""

from __future__ import annotations

import ast

from support import CANARY


def test_cant_read_host_shadow(attacker, witness):
    """Read the host's /etc/shadow. Outcome: no such file (the sandbox has its own /etc)."""
    with witness.watching():
        output = attacker.value(
            "import os; os.path.exists('/etc/shadow'), sorted(os.listdir('/etc'))"
        )
    assert output.startswith("(False, ")
    assert "shadow" not in output


def test_cant_read_host_passwd(attacker, witness):
    """Read the host's /etc/passwd. Outcome: only the sandbox's own three accounts."""
    with witness.watching():
        output = attacker.value("[line.split(':')[0] for line in open('/etc/passwd')]")
    assert output == "['root', 'user', 'nobody']\n"


def test_cant_read_host_root_home(attacker, witness):
    """List /root and read the host's shell history. Outcome: only the read-only Python prefix."""
    with witness.watching():
        output = attacker.value(
            "import os\n"
            "def ls(p):\n"
            "    try: return sorted(os.listdir(p))\n"
            "    except OSError as e: return type(e).__name__\n"
            "ls('/root'), os.path.exists('/root/.bashrc'), os.path.exists('/root/.bash_history')"
        )
    assert "False, False)" in output
    assert output.startswith("(['.pyenv'], ") or output.startswith("('FileNotFoundError', ")


def test_cant_read_the_servers_source_or_state(attacker, witness, server_source, secure_server):
    """Open the server's own source files and its state directory by their host paths.
    Outcome: they don't exist inside; only the kernel's own code is mounted."""
    state = secure_server.config.state_dir
    with witness.watching():
        output = attacker.value(
            "import os\n"
            f"[os.path.exists(p) for p in ({str(server_source / 'server' / 'app.py')!r}, "
            f"{str(server_source)!r}, {str(state)!r}, '/proc/1/root/{str(server_source)[1:]}')], "
            "sorted(os.listdir('/opt/cloche/cloche'))"
        )
    assert output == "([False, False, False, False], ['kernel'])\n"


def test_cant_see_host_processes(attacker, witness):
    """Look for the server and other host processes in /proc. Outcome: only the sandbox's own."""
    with witness.watching():
        output = attacker.value(
            "import os\n"
            "cmds = []\n"
            "for pid in os.listdir('/proc'):\n"
            "    if pid.isdigit():\n"
            "        cmds.append(open(f'/proc/{pid}/cmdline', 'rb').read())\n"
            "sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), "
            "any(b'serve' in c or b'pytest' in c or b'runsc' in c for c in cmds)"
        )
    pids, found = ast.literal_eval(output)
    assert found is False
    assert max(pids) < 100  # its own pid namespace: small pids only


def test_cant_see_the_servers_environment(attacker, witness):
    """Search the environment and every /proc/*/environ for the server's canary secret.
    Outcome: it appears nowhere; the sandbox's environment is cloche's own short list."""
    with witness.watching():
        output = attacker.value(
            "import os, glob\n"
            "hits = [k for k, v in os.environ.items() if 'canary' in v]\n"
            "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
            "    try:\n"
            "        if b'canary' in open(path, 'rb').read(): hits.append(path)\n"
            "    except OSError: pass\n"
            "hits, sorted(os.environ)"
        )
    assert CANARY not in output
    assert output.startswith("([], [")
    assert "CLOCHE" not in output


def test_cant_read_another_sessions_files_or_variables(attacker, witness, secure_server):
    """Another session's variables and working directory. Outcome: neither is reachable."""
    with secure_server.client() as other:
        victim = other.run("secret = 'victim-secret'\nopen('victim.txt', 'w').write(secret)")
        with witness.watching():
            output = attacker.value(
                "import os, glob\n"
                "'secret' in globals(), os.listdir('/work'), "
                "[p for root in ('/work', '/tmp', '/opt', '/proc/1/cwd', '/dev', '/run', '/mnt') "
                "for p in glob.glob(root + '/**/victim.txt', recursive=True)]"
            )
        assert output == "(False, [], [])\n"
        assert other.run("secret", victim["session_id"])["output"] == "'victim-secret'\n"
