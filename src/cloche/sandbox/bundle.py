"""Hand-made OCI bundles for runsc: a read-only skeleton rootfs and one config per sandbox."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloche.config import MIB, Limits
from cloche.sandbox import cgroups
from cloche.sandbox.layers import System

USER_UID = 1000  # the template python's `user`; files land on the host with this uid
USER_GID = 1000
HOME = "/home/user"
OLD_WORKDIR = "/work"  # a link to the home, for clients of the sandbox before templates
KERNEL_MOUNT = "/opt/cloche/cloche/kernel"
RUNTIME_MOUNT = "/opt/cloche/site-packages"
DOOR_MOUNT = "/run/cloche"  # the session's doors (host unix sockets: ports, egress), CA bundle
# The session's own packages (`%pip install`): writable, on the kernel's sys.path after the
# runtime's, so that an install can add packages but never replace one the runtime has.
SITE_MOUNT = "/opt/cloche/session-site"
# What root inside the sandbox may do there (gVisor's capabilities, none of the host's):
# Docker's default set, without raw sockets, device nodes and file capabilities.
ROOT_CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
]

_ETC = {
    "passwd": (
        "root:x:0:0:root:/root:/bin/bash\n"
        f"user:x:{USER_UID}:{USER_GID}:user:{HOME}:/bin/bash\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    ),
    "group": f"root:x:0:\nuser:x:{USER_GID}:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost\n",
    "hostname": "sandbox\n",
    "resolv.conf": "",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    # fontconfig's (matplotlib runs fc-list when it first lists fonts): without a config,
    # fc-list prints "Fontconfig error: Cannot load default config file" into the cell.
    "fonts/fonts.conf": (
        '<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "urn:fontconfig:fonts.dtd">\n'
        "<fontconfig><dir>/usr/share/fonts</dir><cachedir>/tmp/.fontconfig</cachedir>"
        "</fontconfig>\n"
    ),
}


@dataclass(frozen=True)
class Mount:
    """A read-only bind mount of a host directory."""

    source: Path
    destination: str


@dataclass(frozen=True)
class VolumeBind:
    """A volume bound into the sandbox: a host directory other sandboxes may bind at the
    same time. runsc gives bind mounts `--file-access-mounts=shared` by default: the
    sentry revalidates what it caches and keeps no file data of its own, so a write of
    one sandbox is read by the others at once (tests/server/test_volumes.py)."""

    source: Path
    destination: str
    read_only: bool = False


def build_rootfs(rootfs: Path, mounts: list[Mount]) -> None:
    """The template python's root: merged-/usr links, our own /etc, the user's home, and
    empty mount points (below each session's layer: never written)."""
    fixed = (HOME[1:], "root", RUNTIME_MOUNT[1:], SITE_MOUNT[1:], DOOR_MOUNT[1:])
    for name in ("usr", "etc", "proc", "dev", "sys", *fixed):
        (rootfs / name).mkdir(parents=True, exist_ok=True)
    (rootfs / "tmp").mkdir(exist_ok=True)
    (rootfs / "tmp").chmod(0o1777)
    os.chown(rootfs / HOME[1:], USER_UID, USER_GID)
    for link, target in (
        ("bin", "usr/bin"),
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
        ("sbin", "usr/sbin"),
        (OLD_WORKDIR[1:], HOME),
    ):
        if not (rootfs / link).is_symlink():
            os.symlink(target, rootfs / link)
    for name, text in _ETC.items():
        (rootfs / "etc" / name).parent.mkdir(exist_ok=True)
        (rootfs / "etc" / name).write_text(text)
    for mount in mounts:
        (rootfs / mount.destination.lstrip("/")).mkdir(parents=True, exist_ok=True)
    rootfs.chmod(0o755)


def oci_config(
    *,
    rootfs: Path,
    args: list[str],
    system: System,
    workdir: Path,
    mounts: list[Mount],
    site_dir: Path | None = None,
    usr_layer: Path | None = None,
    limits: Limits,
    cgroups_path: str,
    cpu_shares: int = cgroups.STARTING_CPU_SHARES,
    root_inside: bool = True,
    volumes: list[VolumeBind] | None = None,
) -> dict[str, Any]:
    """config.json for one sandbox, hardened as the security spec says. The root is the
    session's overlay (writable, bounded by its disk); with root_inside the kernel starts as
    root inside the sandbox, to fork the process supervisor, and then becomes the user.
    Volumes come last, parents before what they hold (one may go inside the home)."""
    ro = ["rbind", "ro", "nosuid", "nodev"]
    rw = ["rbind", "rw", "nosuid", "nodev"]
    oci_mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
    ]
    if usr_layer is not None:
        oci_mounts.append(
            {"destination": "/usr", "type": "bind", "source": str(usr_layer), "options": rw}
        )
    oci_mounts += [
        *(
            {"destination": m.destination, "type": "bind", "source": str(m.source), "options": ro}
            for m in mounts
        ),
        {"destination": system.home, "type": "bind", "source": str(workdir), "options": rw},
    ]
    if site_dir is not None:
        oci_mounts.append(
            {"destination": SITE_MOUNT, "type": "bind", "source": str(site_dir), "options": rw}
        )
    for volume in sorted(volumes or (), key=lambda v: v.destination.count("/")):
        options = ro if volume.read_only else rw
        oci_mounts.append(
            {
                "destination": volume.destination,
                "type": "bind",
                "source": str(volume.source),
                "options": options,
            }
        )
    resources: dict[str, Any] = {
        "memory": {"limit": limits.cgroup_memory_mib * MIB},
        "pids": {"limit": limits.pids_cgroup},
    }
    # A sandbox for the pool starts with a small CPU weight, so that warming the pool (a
    # runsc start, a profile's imports) yields to the cells of sandboxes in use; it gets the
    # usual weight once a session takes it (`cgroups.set_cpu_shares`).
    resources["cpu"] = {"shares": cpu_shares}
    if limits.cpu_quota:
        resources["cpu"] |= {"period": 100_000, "quota": int(limits.cpu_quota * 100_000)}

    def rlimit(kind: str, value: int) -> dict[str, Any]:
        return {"type": kind, "hard": value, "soft": value}

    return {
        "ociVersion": "1.0.2",
        "hostname": "sandbox",
        "root": {"path": str(rootfs), "readonly": False},
        "process": {
            "user": {"uid": 0, "gid": 0} if root_inside else {"uid": system.uid, "gid": system.gid},
            "args": args,
            "env": kernel_env(system),
            "cwd": "/",
            "capabilities": {
                kind: list(ROOT_CAPABILITIES) if root_inside and kind != "inheritable" else []
                for kind in ("bounding", "effective", "inheritable", "permitted")
            },
            "noNewPrivileges": True,
            "rlimits": [
                rlimit("RLIMIT_AS", limits.memory_mib * MIB),
                rlimit("RLIMIT_NPROC", limits.nproc),
                rlimit("RLIMIT_NOFILE", limits.nofile),
                rlimit("RLIMIT_FSIZE", limits.disk_mib * MIB),
                rlimit("RLIMIT_CORE", 0),
            ],
        },
        "mounts": oci_mounts,
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")],
            "cgroupsPath": cgroups_path,
            "resources": resources,
        },
    }


def kernel_env(system: System) -> list[str]:
    """The kernel's environment: the image's, then ours (the kernel becomes the user named
    by CLOCHE_USER, "uid:gid:home", and forgets the variable)."""
    ours = {
        "HOME": system.home,
        "TMPDIR": "/tmp",  # noqa: S108  # the sandbox's own
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": "/tmp/.matplotlib",  # noqa: S108
        "PYTHONDONTWRITEBYTECODE": "1",
        # glibc reserves 64 MiB of address space per thread arena: under RLIMIT_AS that
        # would cap a session at a handful of threads.
        "MALLOC_ARENA_MAX": "2",
        "CLOCHE_USER": f"{system.uid}:{system.gid}:{system.home}",
    }
    env = dict(item.split("=", 1) for item in system.env if "=" in item)
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    env.update(ours)
    return [f"{key}={value}" for key, value in env.items()]
