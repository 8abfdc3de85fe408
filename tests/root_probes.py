"""Probes of the security suite's attacks made as root inside: Python run with the
sandbox's python3 through a command, and the same code on the host for the controls (a
probe that can't tell proves nothing)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

PRELUDE = (
    "import ctypes, errno, json, os, socket\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def attempt(fn, *args):\n"
    "    try:\n"
    "        fn(*args)\n"
    "        return 'done'\n"
    "    except OSError as exc:\n"
    "        return errno.errorcode.get(exc.errno, str(exc.errno))\n"
    "def call(name, *args):\n"
    "    if getattr(libc, name)(*args) != 0:\n"
    "        raise OSError(ctypes.get_errno(), name)\n"
)
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
CAP_CHOWN, CAP_MKNOD, CAP_SYS_ADMIN, CAP_NET_RAW = 0, 27, 21, 13


def py(attacker: Any, code: str, user: str | None = "root") -> Any:
    """Run PRELUDE + code with python3 inside as user; the JSON its last line prints."""
    answer = attacker.sh(f"python3 - <<'PY'\n{PRELUDE}{code}\nPY", user=user)
    assert answer["exit_code"] == 0, (answer["status"], answer["stderr"][-3000:])
    return json.loads(answer["stdout"].splitlines()[-1])


def host_py(code: str, prefix: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Any:
    """The same probe on the host (as the test's root), for the control."""
    done = subprocess.run(
        [*prefix, "python3", "-c", PRELUDE + code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    )
    return json.loads(done.stdout.splitlines()[-1])


def capabilities(attacker: Any, user: str | None = "root") -> int:
    """The effective capability set of a command."""
    status = attacker.out("grep CapEff /proc/self/status", user=user)
    return int(status.split()[1], 16)
