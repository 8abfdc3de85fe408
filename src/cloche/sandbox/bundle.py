"""Hand-made OCI bundles for runsc: a read-only skeleton rootfs and one config per sandbox."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloche.config import MIB, Limits
from cloche.sandbox import cgroups

SANDBOX_UID = 10001  # no account on the host; files land on the host with this uid
SANDBOX_GID = 10001
WORKDIR = "/work"
KERNEL_MOUNT = "/opt/cloche/cloche/kernel"
RUNTIME_MOUNT = "/opt/cloche/site-packages"
DOOR_MOUNT = "/run/cloche"  # egress: the session's door (a host unix socket) and CA bundle
# The session's own packages (`%pip install`): writable, on the kernel's sys.path after the
# runtime's, so that an install can add packages but never replace one the runtime has.
SITE_MOUNT = "/opt/cloche/session-site"

_ETC = {
    "passwd": (
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"sandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:{WORKDIR}:/usr/sbin/nologin\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    ),
    "group": f"root:x:0:\nsandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n",
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


def build_rootfs(rootfs: Path, mounts: list[Mount]) -> None:
    """The skeleton root: merged-/usr symlinks, our own /etc, and empty mount points."""
    fixed = (WORKDIR.strip("/"), RUNTIME_MOUNT[1:], SITE_MOUNT[1:], DOOR_MOUNT[1:])
    for name in ("usr", "etc", "tmp", "proc", "dev", "sys", *fixed):
        (rootfs / name).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        if not (rootfs / link).is_symlink():
            os.symlink(f"usr/{link}", rootfs / link)
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
    workdir: Path,
    mounts: list[Mount],
    site_dir: Path | None = None,
    limits: Limits,
    cgroups_path: str,
    cpu_shares: int = cgroups.STARTING_CPU_SHARES,
) -> dict[str, Any]:
    """config.json for one sandbox, hardened as the security spec says."""
    ro = ["rbind", "ro", "nosuid", "nodev"]
    oci_mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/usr", "type": "bind", "source": "/usr", "options": ro},
        *(
            {"destination": m.destination, "type": "bind", "source": str(m.source), "options": ro}
            for m in mounts
        ),
        {
            "destination": "/tmp",  # noqa: S108  # the sandbox's own tmpfs
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=1777", f"size={limits.disk_mib}m"],
        },
        {
            "destination": WORKDIR,
            "type": "bind",
            "source": str(workdir),
            "options": ["rbind", "rw", "nosuid", "nodev"],
        },
    ]
    if site_dir is not None:
        oci_mounts.append(
            {
                "destination": SITE_MOUNT,
                "type": "bind",
                "source": str(site_dir),
                "options": ["rbind", "rw", "nosuid", "nodev"],
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
        "root": {"path": str(rootfs), "readonly": True},
        "process": {
            "user": {"uid": SANDBOX_UID, "gid": SANDBOX_GID},
            "args": args,
            "env": [
                "PATH=/usr/local/bin:/usr/bin:/bin",
                f"HOME={WORKDIR}",
                "LANG=C.UTF-8",
                "TMPDIR=/tmp",
                "MPLBACKEND=Agg",
                "MPLCONFIGDIR=/tmp/.matplotlib",
                "PYTHONDONTWRITEBYTECODE=1",
                # glibc reserves 64 MiB of address space per thread arena: under RLIMIT_AS
                # that would cap a session at a handful of threads.
                "MALLOC_ARENA_MAX=2",
            ],
            "cwd": WORKDIR,
            "capabilities": {"bounding": [], "effective": [], "inheritable": [], "permitted": []},
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
