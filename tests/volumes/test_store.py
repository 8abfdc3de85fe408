"""The volume store on the host (real loop mounts, no sandbox): made, found again after a
restart or a crash, leased and mounted only while leased, held to its size, deleted."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloche.config import MIB
from cloche.errors import (
    ConfigError,
    VolumeError,
    VolumeExists,
    VolumeFull,
    VolumeNotFound,
    VolumeRefused,
)
from cloche.sandbox import mounts
from cloche.volumes import quota
from cloche.volumes.files import VolumeFiles
from cloche.volumes.store import IMAGE, VolumeStore

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="volumes are loop-mounted: root only"),
]
OWNER = "a" * 64


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "volumes"
    for point in mounts.mounts_under(tmp_path):  # whatever a failed test left
        mounts.unmount(point)


@pytest.fixture
def store(root: Path) -> Iterator[VolumeStore]:
    opened = VolumeStore(root, max_mib=64)
    opened.open()
    yield opened
    opened.close()


def attached(root: Path, timeout_s: float = 30.0) -> list[str]:
    """Loop devices attached to images under root, once none is left or after timeout_s (a
    loop device lets go of its image just after the last unmount, not at once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True)
        found = [line for line in out.stdout.splitlines() if str(root) in line]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_a_volume_is_mounted_only_while_leased(store: VolumeStore, root: Path) -> None:
    store.create(OWNER, "data", 8)
    assert mounts.mounts_under(root) == [] and attached(root) == []
    first = store.lease(OWNER, "data")
    second = store.lease(OWNER, "data")
    assert first.directory == second.directory
    (first.directory / "f").write_text("x")
    first.release()
    first.release()  # a lease is let go once, however often it is asked
    assert (second.directory / "f").read_text() == "x"
    second.release()
    assert mounts.mounts_under(root) == [] and attached(root) == []
    used, capacity = store.usage(store.get(OWNER, "data"))
    assert 0 < used < capacity <= 8 * MIB
    assert capacity > 7 * MIB  # ext4 without a journal keeps ~4% for itself


def test_a_read_only_lease_is_read_only_on_the_host(store: VolumeStore) -> None:
    store.create(OWNER, "data", 4)
    writer = store.lease(OWNER, "data")
    (writer.directory / "f").write_text("kept")
    reader = store.lease(OWNER, "data", read_only=True)
    with pytest.raises(OSError) as refused:
        os.open(reader.directory / "f", os.O_RDONLY | os.O_TRUNC)
    assert refused.value.errno == errno.EROFS
    assert (reader.directory / "f").read_text() == "kept"
    reader.release()
    writer.release()


def attach_unmountable(image: Path) -> str:
    """A loop device attached to image at an offset, where no file system starts."""
    return subprocess.run(
        ["losetup", "-f", "--show", "-o", "4096", str(image)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_a_loop_device_on_its_way_out_is_waited_for_then_the_volume_mounts(
    store: VolumeStore, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last lease's unmount is lazy: its loop device lets go of the image just after,
    and a lease taken meanwhile found it still attached, could not read a superblock
    through it and failed (a 503 once in a full run). Simulated: a device that can't be
    mounted, let go as the mount through it fails."""
    store.create(OWNER, "data", 8)
    [image] = root.rglob(IMAGE)
    device = attach_unmountable(image)
    mount_through = quota._run

    def run(command: list[str], what: str) -> None:
        try:
            mount_through(command, what)
        except VolumeError:
            if device in command:
                subprocess.run(["losetup", "-d", device], check=True)
            raise

    monkeypatch.setattr(quota, "_run", run)
    lease = store.lease(OWNER, "data")
    (lease.directory / "f").write_text("x")
    lease.release()
    assert mounts.mounts_under(root) == [] and attached(root) == []


def test_a_loop_device_that_stays_attached_is_an_error_not_a_second_file_system(
    store: VolumeStore, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.create(OWNER, "data", 8)
    [image] = root.rglob(IMAGE)
    monkeypatch.setattr(quota, "DETACH_WAIT_S", 0.5)
    device = attach_unmountable(image)
    try:
        with pytest.raises(VolumeError, match="could not mount the volume"):
            store.lease(OWNER, "data")
        assert mounts.mounts_under(root) == []
    finally:
        subprocess.run(["losetup", "-d", device], check=True)


def test_names_are_per_owner_and_checked(store: VolumeStore) -> None:
    store.create(OWNER, "data", 4)
    store.create(None, "data", 4)  # a server without tokens: its own owner directory
    with pytest.raises(VolumeExists):
        store.create(OWNER, "data", 4)
    with pytest.raises(VolumeNotFound):
        store.get("b" * 64, "data")
    for name in ("", ".", "..", "a/b", "-x", "x" * 65, "a\0b"):
        with pytest.raises(VolumeRefused):
            store.create(OWNER, name, 4)
    for size in (0, -1, 65, 1.5):
        with pytest.raises(VolumeRefused):
            store.create(OWNER, "sized", size)  # type: ignore[arg-type]
    assert [v.name for v in store.of_owner(OWNER)] == ["data"]


def test_a_restarted_store_finds_its_volumes_and_cleans_what_a_crash_left(root: Path) -> None:
    first = VolumeStore(root, max_mib=64)
    first.open()
    first.create(OWNER, "kept", 4)
    lease = first.lease(OWNER, "kept")
    (lease.directory / "f").write_text("survives")
    reader = first.lease(OWNER, "kept", read_only=True)
    # A crash: the lock goes with the process, its mounts stay, a volume was half made.
    assert first._lock_fd is not None
    os.close(first._lock_fd)
    half = root / OWNER / ".new-0123"
    half.mkdir()
    (half / "image.ext4").write_bytes(b"")
    assert len(mounts.mounts_under(root)) == 2
    second = VolumeStore(root, max_mib=64)
    second.open()
    try:
        assert mounts.mounts_under(root) == [] and attached(root) == []
        assert not half.exists()
        assert [v.name for v in second.of_owner(OWNER)] == ["kept"]
        again = second.lease(OWNER, "kept")
        assert (again.directory / "f").read_text() == "survives"
        again.release()
        del reader
    finally:
        second.close()
    assert mounts.mounts_under(root) == [] and attached(root) == []


def test_one_directory_one_server(store: VolumeStore, root: Path) -> None:
    with pytest.raises(ConfigError, match="in use by another cloche server"):
        VolumeStore(root, max_mib=64).open()


def test_a_volume_never_holds_more_than_its_size(store: VolumeStore) -> None:
    store.create(OWNER, "small", 4)
    lease = store.lease(OWNER, "small")
    try:
        with pytest.raises(OSError) as full, open(lease.directory / "big", "wb") as out:
            for _ in range(8):
                out.write(b"x" * MIB)
                out.flush()
        assert full.value.errno == errno.ENOSPC
        files = VolumeFiles(lease.directory, "small", quota.usage(lease.directory)[1])
        streamed = files.streamed("other")
        streamed.open()
        try:
            with pytest.raises(VolumeFull, match="volume 'small' is full"):
                streamed.write(b"y" * MIB)
        finally:
            streamed.discard()
        assert sorted(os.listdir(lease.directory)) == ["big"]
    finally:
        lease.release()


def test_delete_removes_its_files_and_mounts(store: VolumeStore, root: Path) -> None:
    store.create(OWNER, "gone", 4)
    lease = store.lease(OWNER, "gone")
    store.delete(OWNER, "gone")  # a lease still held keeps nothing alive on the host
    lease.release()
    assert not (root / OWNER / "gone").exists()
    assert mounts.mounts_under(root) == [] and attached(root) == []
    with pytest.raises(VolumeNotFound):
        store.lease(OWNER, "gone")
