"""Attacks that try to write outside the sandbox's own space or gain privileges."""

from __future__ import annotations

from support import slowness

SLOW = slowness()  # as many times longer as this machine is slower (an emulated CPU)

TRY = (
    "import os, errno\n"
    "def attempt(fn, *args):\n"
    "    try:\n"
    "        fn(*args)\n"
    "        return 'done'\n"
    "    except OSError as exc:\n"
    "        return errno.errorcode.get(exc.errno, str(exc.errno))\n"
    "def write(path):\n"
    "    with open(path, 'w') as f: f.write('x')\n"
)


def test_cant_write_outside_the_working_directory_and_tmp(attacker, witness):
    """Write to /, /usr, /etc, /opt (the kernel's code), the Python prefix, /proc/sys, /sys.
    Outcome: every write fails; the home (/home/user, /work links to it) and /tmp are the
    user's only writable places."""
    import sys

    targets = [
        "/x",
        "/usr/x",
        "/etc/passwd",
        "/opt/cloche/cloche/kernel/main.py",
        f"{sys.base_prefix}/x",
        "/proc/sys/kernel/hostname",
        "/sys/x",
        "/root/x",
    ]
    with witness.watching():
        output = attacker.value(TRY + f"[attempt(write, p) for p in {targets!r}]")
    assert "done" not in output


def test_cant_become_root(attacker, witness):
    """setuid(0), setgid(0), and the setuid bit on su/sudo/mount. Outcome: all refused."""
    with witness.watching():
        output = attacker.value(
            TRY + "import subprocess\n"
            "tools = (['su', '-c', 'id'], ['sudo', 'id'], ['mount', '-t', 'tmpfs', 'x', '/tmp'])\n"
            "def su():\n"
            "    for tool in tools:\n"
            "        try:\n"
            "            done = subprocess.run(\n"
            f"                tool, capture_output=True, timeout={5 * SLOW:g}, "
            "stdin=subprocess.DEVNULL)\n"
            "        except FileNotFoundError:\n"
            "            continue\n"
            "        if done.returncode == 0 and b'uid=0' in done.stdout:\n"
            "            raise SystemExit('root')\n"
            "su()\n"
            "attempt(os.setuid, 0), attempt(os.setgid, 0), os.getuid(), os.geteuid()"
        )
    assert output == "('EPERM', 'EPERM', 1000, 1000)\n"


def test_cant_gain_capabilities_or_mount(attacker, witness):
    """mount(2), chroot, unshare a mount namespace, load a kernel module, open a device node
    made for host memory. Outcome: all refused (gVisor lets the node be made, on its own
    tmpfs, but there is no device behind it). A user namespace of its own is allowed, as on
    Linux: see test_cant_mount_as_root_inside."""
    with witness.watching():
        output = attacker.value(
            TRY + "import ctypes\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "def call(name, *args):\n"
            "    if getattr(libc, name)(*args) != 0:\n"
            "        raise OSError(ctypes.get_errno(), name)\n"
            # unshare from a child of one thread: the kernel's many threads would make it
            # EINVAL whatever the privileges.
            "def in_child(fn, *args):\n"
            "    reader, writer = os.pipe()\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        os.write(writer, attempt(fn, *args).encode())\n"
            "        os._exit(0)\n"
            "    os.close(writer)\n"
            "    os.waitpid(pid, 0)\n"
            "    return os.read(reader, 64).decode()\n"
            "[attempt(call, 'mount', b'x', b'/tmp', b'tmpfs', 0, None),\n"
            " attempt(os.chroot, '/tmp'),\n"
            " in_child(call, 'unshare', 0x20000),\n"
            " attempt(call, 'init_module', None, 0, b''),\n"
            " attempt(os.mknod, '/tmp/mem', 0o600 | 0o020000, os.makedev(1, 1)),\n"
            " attempt(lambda: open('/tmp/mem', 'rb').read(16))]"
        )
    assert output.split(", ")[:4] == ["['EPERM'", "'EPERM'", "'EPERM'", "'EPERM'"]
    assert output.endswith("'ENXIO']\n")


def test_cant_ptrace_anything_outside(attacker, witness):
    """ptrace-attach to pids that would be host processes. Outcome: no such process."""
    with witness.watching():
        output = attacker.value(
            TRY + "import ctypes\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "def attach(pid):\n"
            "    if libc.ptrace(16, pid, None, None) != 0:\n"
            "        raise OSError(ctypes.get_errno(), 'ptrace')\n"
            "[attempt(attach, pid) for pid in (1000, 4000, 30000)]"
        )
    assert "done" not in output
