"""How a volume's size is held: each volume is an ext4 file system in an image file of
exactly its size, loop-mounted on the host while something uses it.

Why an image: the limit must hold for writes made inside gVisor, which reach the host
through the sandbox's file server running as root (no rlimit or uid quota of the sandbox's
applies there); it must outlive the server (a tmpfs would not); and it must not depend on
the host's file system (XFS or ext4 project quotas need --volumes-dir on a file system
mounted with `prjquota`, which a server can't assume). A file system of the volume's size
simply ends there: a write past it fails with ENOSPC, inside the sandbox as in the files
API, and nothing else on the host fills up.

The image is allocated in full when made (fallocate: the host's disk can't run out under
a volume later), and formatted without a journal (ext4's metadata then takes 3-5% of it,
against 6-16% with one) with 4 KiB blocks and an inode per 16 KiB. Without a journal a
host crash can leave it inconsistent: it is checked (`e2fsck -p`, which repairs what is
safe to) before every mount, in milliseconds when it is clean.

A volume is mounted through a loop device that frees itself when the last mount of it
goes (util-linux's autoclear). Before mounting, a loop device still attached to the image
(mounted in some other namespace, or being released) is reused, never a second one: two
ext4 instances on one image would corrupt it.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from cloche.config import MIB
from cloche.errors import VolumeError

MKFS_OPTIONS = ("-q", "-F", "-T", "default", "-O", "^has_journal", "-m", "0", "-E", "nodiscard")
MOUNT_OPTIONS = "nosuid,nodev,noatime"
COMMAND_TIMEOUT_S = 120.0  # mkfs or fsck of a large image on a busy disk
DETACH_WAIT_S = 10.0  # a loop device's autoclear after the last unmount, on a busy host
# e2fsck -p's exit status: 0 clean, 1 repaired, 2 repaired (reboot advised, not for us)
_FSCK_FINE = (0, 1, 2)


def make_image(image: Path, size_mib: int) -> None:
    """Make an image of size_mib holding an empty ext4 file system (blocking).

    Raises:
        OSError: ENOSPC when the host's disk has no room for it, or another failure.
        VolumeError: mkfs failed.
    """
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size_mib * MIB)
    finally:
        os.close(fd)
    _run(["mkfs.ext4", *MKFS_OPTIONS, str(image)], "format")


def attached_device(image: Path) -> str | None:
    """The loop device attached to image, if any (`losetup -j`)."""
    done = subprocess.run(
        ["losetup", "-j", str(image)],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    line = done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
    return line.split(":", 1)[0] if line.startswith("/dev/") else None


def mount_image(image: Path, point: Path) -> None:
    """Mount image's file system on point (blocking): through the loop device already
    attached to it, if one is; else checked first, then through a new loop device.

    Raises:
        VolumeError: it is damaged beyond what e2fsck -p repairs, or would not mount.
    """
    device = attached_device(image)
    if device is not None:
        try:
            _run(["mount", "-t", "ext4", "-o", MOUNT_OPTIONS, device, str(point)], "mount")
            return
        except VolumeError:
            # A device on its way out: the last unmount was lazy, and the loop device lets
            # go of the image just after (its superblock can't be read meanwhile). Once
            # it has, the image is mounted afresh. One that stays is still in use (a
            # second file system on the image would corrupt it): that is the error.
            if not _let_go(image, DETACH_WAIT_S):
                raise
    done = subprocess.run(
        ["e2fsck", "-p", str(image)],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    if done.returncode not in _FSCK_FINE:
        raise VolumeError(
            f"the volume's file system in {image} is damaged (e2fsck -p: "
            f"{_last_line(done)}); repair it with e2fsck while the server is stopped"
        )
    _run(["mount", "-t", "ext4", "-o", f"loop,{MOUNT_OPTIONS}", str(image), str(point)], "mount")


def usage(point: Path) -> tuple[int, int]:
    """(used, capacity) in bytes of the file system mounted on point: what its files take,
    and what they may take in all (its size less ext4's own metadata)."""
    fs = os.statvfs(point)
    return (fs.f_blocks - fs.f_bfree) * fs.f_frsize, fs.f_blocks * fs.f_frsize


def _let_go(image: Path, wait_s: float) -> bool:
    """Whether no loop device is attached to image within wait_s (blocking)."""
    deadline = time.monotonic() + wait_s
    while attached_device(image) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # the kernel's autoclear gives no event to wait on
    return True


def _run(command: list[str], what: str) -> None:
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise VolumeError(f"could not {what} the volume: {exc}") from exc
    if done.returncode != 0:
        raise VolumeError(f"could not {what} the volume: {_last_line(done)}")


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"
