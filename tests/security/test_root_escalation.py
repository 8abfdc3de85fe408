"""Attacks made as root inside the sandbox through commands, against gVisor's own kernel:
mounts, /proc, devices, chroot, namespaces and ptrace, a fork bomb; and the user's writes to
the system.

Each probe that could pass for the wrong reason is also run where it must succeed (on the
host, or as root where the user is refused).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from root_probes import (
    CAP_CHOWN,
    CAP_MKNOD,
    CAP_SYS_ADMIN,
    MS_BIND,
    MS_REC,
    MS_REMOUNT,
    capabilities,
    host_py,
    py,
)

MOUNTS = (
    "os.makedirs('/tmp/m', exist_ok=True)\n"
    "KERNEL = b'/opt/cloche/cloche/kernel'\n"
    "MOUNTS = {\n"
    "    'tmpfs': (b'none', b'/tmp/m', b'tmpfs', 0, None),\n"
    "    'proc': (b'proc', b'/tmp/m', b'proc', 0, None),\n"
    "    'sysfs': (b'sysfs', b'/tmp/m', b'sysfs', 0, None),\n"
    "    'devpts': (b'devpts', b'/tmp/m', b'devpts', 0, None),\n"
    "    'cgroup2': (b'cgroup2', b'/tmp/m', b'cgroup2', 0, None),\n"
    "    'overlay': (b'overlay', b'/tmp/m', b'overlay', 0,\n"
    "                b'lowerdir=/usr,upperdir=/tmp/u,workdir=/tmp/w'),\n"
    "    'a disk': (b'/dev/vda', b'/tmp/m', b'ext4', 0, None),\n"
    "    '9p': (b'none', b'/tmp/m', b'9p', 0, b'trans=fd,rfdno=0,wfdno=0'),\n"
    "    'fuse': (b'fuse', b'/tmp/m', b'fuse', 0, b'fd=0,rootmode=40000,user_id=0,group_id=0'),\n"
    f"    'bind': (b'/home/user', b'/tmp/m', None, {MS_BIND}, None),\n"
    f"    'rbind of /': (b'/', b'/tmp/m', None, {MS_BIND | MS_REC}, None),\n"
    f"    'remount of /': (b'none', b'/', None, {MS_REMOUNT}, None),\n"
    f"    'remount of the kernel rw': (None, KERNEL, None, {MS_REMOUNT | MS_BIND}, None),\n"
    "}\n"
)


def test_cant_mount_as_root_inside(attacker, witness, tmp_path):
    """As root inside, mount(2) of every kind: tmpfs, proc, sysfs, devpts, cgroup2, overlay, a
    disk, 9p, fuse, a bind and a recursive bind of /, a remount of / and of the kernel's
    read-only code; then the same in a user and mount namespace of its own. Outcome: each is
    EPERM in the sandbox's namespace (root's capabilities leave out CAP_SYS_ADMIN); in a
    namespace of its own, which any process may make (as on Linux), a tmpfs mount is
    gVisor's, seen by no other process of the sandbox and nowhere on the host."""
    probe = MOUNTS + (
        "print(json.dumps({name: attempt(call, 'mount', *args) for name, args in MOUNTS.items()}))"
    )
    with witness.watching():
        caps = capabilities(attacker)
        results = py(attacker, probe)
        nested = attacker.out(
            "mkdir -p /tmp/n && unshare -Urm sh -c "
            "'mount -t tmpfs none /tmp/n && touch /tmp/n/made && ls /tmp/n'; "
            "echo; ls -A /tmp/n; grep -c /tmp/n /proc/self/mountinfo",
            user=None,
        )
    assert caps & (1 << CAP_CHOWN) and not caps & (1 << CAP_SYS_ADMIN), hex(caps)
    assert results == dict.fromkeys(results, "EPERM"), results
    assert nested.split("\n")[:3] == ["made", "", "0"], nested
    # The probe can tell: on the host, in a mount namespace of its own, the same call mounts.
    host = host_py(
        f"print(json.dumps(attempt(call, 'mount', b'none', {str(tmp_path).encode()!r}, "
        "b'tmpfs', 0, None)))",
        prefix=("unshare", "--mount", "--propagation", "private"),
    )
    assert host == "done"


PROCESSES = (
    "found = {}\n"
    "for pid in os.listdir('/proc'):\n"
    "    if pid.isdigit():\n"
    "        try: found[pid] = open(f'/proc/{pid}/cmdline', 'rb').read().decode(errors='replace')\n"
    "        except OSError: pass\n"
)
PROC_WRITES = (
    "/proc/sys/kernel/hostname",
    "/proc/sys/kernel/core_pattern",
    "/proc/sys/kernel/modprobe",
    "/proc/sys/vm/drop_caches",
    "/proc/sys/net/ipv4/ip_forward",
    "/proc/sysrq-trigger",
)


def host_values() -> dict[str, str]:
    """The host's values of the /proc files the attack writes, where they can be read."""
    values = {}
    for path in PROC_WRITES:
        try:
            values[path] = Path(path).read_text()
        except OSError:
            continue  # missing, or write-only (drop_caches, sysrq-trigger)
    return values


def test_cant_see_host_processes_or_write_proc_as_root(attacker, witness, secure_server):
    """As root inside, list /proc for the server, runsc and other host processes, read every
    environ and cmdline, and write /proc/sys (hostname, core_pattern, modprobe, drop_caches,
    ip_forward) and /proc/sysrq-trigger. Outcome: only the sandbox's own processes (the
    kernel, its supervisor, the command); every write fails but ip_forward's, which sets
    gVisor's own network stack (loopback only); the host's values are unchanged."""
    before = host_values()
    looks_for = ("serve", "pytest", "runsc", "dockerd", "systemd", "sshd", "containerd")
    probe = PROCESSES + (
        "mine = {str(os.getpid()), str(os.getppid())}  # the probe and its shell hold the words\n"
        f"hits = sorted(p for p, c in found.items() if p not in mine and\n"
        f"              any(w in c for w in {looks_for!r}))\n"
        "def write(path):\n"
        "    with open(path, 'w') as f: f.write('1')\n"
        f"writes = {{p: attempt(write, p) for p in {PROC_WRITES!r}}}\n"
        "print(json.dumps([sorted(found, key=int), hits, writes]))"
    )
    with witness.watching():
        pids, hits, writes = py(attacker, probe)
    assert hits == [] and max(int(p) for p in pids) < 1000, (pids, hits)
    # ip_forward is a setting of gVisor's own network stack (the sandbox's loopback alone).
    assert {p for p, r in writes.items() if r == "done"} <= {PROC_WRITES[4]}, writes
    assert host_values() == before
    # The probe can tell: on the host it finds this test's own process.
    assert str(os.getpid()) in host_py(PROCESSES + "print(json.dumps(sorted(found)))")


DEVICES = (
    "/dev/mem",
    "/dev/kmem",
    "/dev/port",
    "/dev/kmsg",
    "/dev/sda",
    "/dev/vda",
    "/dev/nvme0n1",
    "/dev/loop0",
    "/dev/dm-0",
    "/dev/kvm",
)


def test_cant_reach_devices_as_root(attacker, witness, secure_server):
    """As root inside, open the host's memory, kernel log and disks by their device paths,
    and make device nodes for them (mknod) in /tmp and in the session's layer, then read
    them. Outcome: none of those paths exists; a node can be made (gVisor's own files:
    Linux would need CAP_MKNOD, which root here lacks) but there is no device behind it,
    and none reaches the host's copy of the layer as a device."""
    nodes = {
        "/tmp/mem": "(1, 1)",
        "/root/mem": "(1, 1)",
        "/root/kmsg": "(1, 11)",
        "/root/sda": "(8, 0)",
    }
    probe = (
        "import stat\n"
        f"opened = {{p: attempt(lambda p=p: os.open(p, os.O_RDONLY)) for p in {DEVICES!r}}}\n"
        "def node(path, numbers, kind):\n"
        "    os.mknod(path, 0o600 | kind, os.makedev(*numbers))\n"
        "def read(path):\n"
        "    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)\n"
        "    try:\n"
        "        if os.read(fd, 16): raise OSError(0, 'read something')\n"
        "    finally: os.close(fd)\n"
        "made, reads = {}, {}\n"
        f"for path, numbers in {nodes!r}.items():\n"
        "    kind = stat.S_IFBLK if path.endswith('sda') else stat.S_IFCHR\n"
        "    made[path] = attempt(node, path, eval(numbers), kind)\n"
        "    reads[path] = attempt(read, path)\n"
        "print(json.dumps([sorted(os.listdir('/dev')), opened, made, reads]))"
    )
    with witness.watching():
        devices, opened, made, reads = py(attacker, probe)
    assert set(opened.values()) == {"ENOENT"}, opened
    assert not set(devices) & {Path(p).name for p in DEVICES}, devices
    assert "done" not in reads.values(), (made, reads)
    assert not capabilities(attacker) & (1 << CAP_MKNOD)
    # On the host, the session's layer holds no device node but overlay whiteouts (0:0).
    for top in secure_server.config.state_dir.glob("*/sandboxes/*/disk"):
        for directory, _, files in os.walk(top):
            for name in files:
                info = os.lstat(os.path.join(directory, name))
                if info.st_mode & 0o170000 in (0o020000, 0o060000):
                    assert info.st_rdev == 0, os.path.join(directory, name)
    # The probe can tell: the host has some of these devices.
    assert [p for p in DEVICES if os.path.exists(p)] != []


WRITES = (
    "/x",
    "/etc/passwd",
    "/etc/x",
    "/usr/local/bin/x",
    "/usr/lib/x",
    "/root/x",
    "/run/x",
    "/opt/cloche/cloche/kernel/x",
    "/opt/cloche/site-packages/x",
)


def test_a_user_command_cant_write_the_system(attacker, witness):
    """As the session's user, write /, /etc, /usr, /root, /var and cloche's own code inside.
    Outcome: every write fails (EACCES, or EROFS for cloche's read-only mounts), while root
    inside writes the same system paths into the session's layer."""
    probe = (
        "def write(path):\n"
        "    with open(path, 'a') as f: f.write('x')\n"
        f"print(json.dumps({{p: attempt(write, p) for p in {WRITES!r}}}))"
    )
    with witness.watching():
        as_user = py(attacker, probe, user=None)
        as_root = py(attacker, probe)
    assert set(as_user.values()) <= {"EACCES", "EROFS", "EPERM"}, as_user
    assert {p for p, r in as_root.items() if r == "done"} == set(WRITES[:7]), as_root


def test_cant_escape_by_chroot_pivot_root_unshare_or_ptrace_as_root(
    attacker, witness, secure_server, server_source
):
    """As root inside, break out of a chroot the classic way (chroot into a subdirectory while
    the working directory stays outside it, climb with `..`, chroot again), pivot_root,
    unshare mount, pid and network namespaces without a user namespace, and ptrace, signal
    or read the memory of the server's and runsc's pids. Outcome: the climb ends inside
    gVisor's own file system (an empty directory above the sandbox's root: nothing of the
    host, the server's source or /etc/shadow); pivot_root and the namespaces
    are EPERM; the host's pids don't exist inside (ESRCH)."""
    host_pids = [os.getpid(), os.getppid()]
    probe = (
        "os.makedirs('/tmp/jail/inner', exist_ok=True)\n"
        "root_before = sorted(os.listdir('/'))\n"
        "reader, writer = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.chdir('/tmp/jail')\n"
        "    os.chroot('inner')  # the working directory is left outside the new root\n"
        "    for _ in range(64): os.chdir('..')\n"
        "    os.chroot('.')\n"
        "    out = [sorted(os.listdir('/')), os.path.exists('/etc/shadow'),\n"
        f"           os.path.exists({str(server_source)!r})]\n"
        "    os.write(writer, json.dumps(out).encode())\n"
        "    os._exit(0)\n"
        "os.close(writer)\n"
        "os.waitpid(pid, 0)\n"
        "climbed = json.loads(os.read(reader, 65536))\n"
        "climbed[0] = set(climbed[0]) <= set(root_before)\n"
        "os.makedirs('/tmp/old', exist_ok=True)\n"
        "pivot = attempt(lambda: call('syscall', 155, b'/tmp', b'/tmp/old'))\n"
        "spaces = {name: attempt(call, 'unshare', flag) for name, flag in\n"
        "          (('mount', 0x20000), ('pid', 0x20000000), ('net', 0x40000000))}\n"
        "iov = (ctypes.c_char * 8)()\n"
        "class Iovec(ctypes.Structure):\n"
        "    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]\n"
        "vec = Iovec(ctypes.addressof(iov), 8)\n"
        "def readv(p):\n"
        "    if libc.process_vm_readv(p, ctypes.byref(vec), 1, ctypes.byref(vec), 1, 0) < 0:\n"
        "        raise OSError(ctypes.get_errno(), 'process_vm_readv')\n"
        "outside = {str(p): [attempt(call, 'ptrace', 16, p, None, None),\n"
        "                    attempt(os.kill, p, 0), attempt(readv, p)]\n"
        f"           for p in {host_pids!r}}}\n"
        "print(json.dumps([climbed, pivot, spaces, outside]))"
    )
    with witness.watching():
        climbed, pivot, spaces, outside = py(attacker, probe)
    assert climbed == [True, False, False], climbed
    assert pivot == "EPERM" and spaces == dict.fromkeys(spaces, "EPERM"), (pivot, spaces)
    assert all(r == ["ESRCH"] * 3 for r in outside.values()), outside
    # The probe can tell: on the host those pids are alive.
    for pid in host_pids:
        os.kill(pid, 0)


def test_a_fork_bomb_as_root_is_contained(attacker, witness, secure_server):
    """As root inside, a shell fork bomb in a background command, which is then killed.
    Outcome: the process limit holds it (gVisor's RLIMIT_NPROC applies to root inside,
    which has no CAP_SYS_RESOURCE); the kill takes its whole process group; the session
    may die, the server and every other session go on."""
    limit = secure_server.config.limits.nproc
    commands = f"/v1/sessions/{attacker.session_id}/commands"
    body = {"cmd": "bomb() { bomb | bomb & }; bomb; sleep 600", "user": "root"}
    with witness.watching():
        started = attacker.http.post(commands, json={**body, "background": True})
        assert started.status_code == 201, started.text
        seen = [count_processes(attacker)]
        deadline = time.monotonic() + 60
        while (seen[-1] or 0) < limit // 2 and seen[-1] is not None:
            assert time.monotonic() < deadline, f"the bomb never grew: {seen}"
            time.sleep(0.2)  # polling the process table, with a deadline
            seen.append(count_processes(attacker))
        for _ in range(5):
            if seen[-1] is None:  # the session died of it
                break
            seen.append(count_processes(attacker))
        killed = attacker.http.delete(f"{commands}/{started.json()['pid']}")
        assert killed.status_code in (204, 400, 404), killed.text
        deadline = time.monotonic() + 60
        left = seen[-1]
        if killed.status_code == 400:  # the supervisor went down first, with its sandbox
            while (left := count_processes(attacker)) is not None:
                assert time.monotonic() < deadline, f"kill refused, session alive: {killed.text}"
                time.sleep(0.2)  # polling the session, with a deadline
        while left is not None and (left := count_processes(attacker)) is not None and left > 4:
            assert time.monotonic() < deadline, f"{left} processes left after the kill"
            time.sleep(0.2)  # polling the process table, with a deadline
    # Root's processes stay within the limit (the kernel, its supervisor and the probe
    # are counted beside them).
    assert max(n for n in seen if n is not None) <= limit + 4, seen


def count_processes(attacker) -> int | None:
    """How many processes the session has, seen by a cell (a command could not start while
    root's processes fill the limit: the supervisor forks as root); None: it is gone."""
    reply = attacker.run("import os\nlen([p for p in os.listdir('/proc') if p.isdigit()])")
    if reply["status"] != "ok":
        # It died of this cell (session_alive false), or earlier and is gone from the server.
        gone = attacker.http.get(f"/v1/sessions/{attacker.session_id}").status_code == 404
        assert reply.get("session_alive") is False or gone, reply
        return None
    return int(str(reply["output"]))
