"""Host access to a working directory the sandbox controls: read as a list of attacks."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cloche.errors import PathNotFound, PathRefused, SessionError
from cloche.protocol.paths import normalise
from cloche.sandbox import files as files_module
from cloche.sandbox.bundle import USER_GID as SANDBOX_GID
from cloche.sandbox.bundle import USER_UID as SANDBOX_UID
from cloche.sandbox.files import FileInfo, WorkdirFiles, changed

LIMIT_BYTES = 1024
SECRET = b"host secret, never to be read"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    return work


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A host directory next to the working directory, with a secret in it."""
    host = tmp_path / "outside"
    host.mkdir()
    (host / "secret.txt").write_bytes(SECRET)
    return host


@pytest.fixture
def files(root: Path) -> WorkdirFiles:
    return WorkdirFiles(root, None, None, max_file_bytes=LIMIT_BYTES)


def outside_untouched(outside: Path) -> bool:
    return sorted(os.listdir(outside)) == ["secret.txt"] and (
        (outside / "secret.txt").read_bytes() == SECRET
    )


# Round trips


def test_write_then_read_round_trips(files: WorkdirFiles) -> None:
    files.write("hello.txt", b"hello\x00world")
    assert files.read("hello.txt") == b"hello\x00world"


def test_empty_files_round_trip(files: WorkdirFiles) -> None:
    files.write("empty", b"")
    assert files.read("empty") == b""


def test_write_creates_missing_parent_directories(files: WorkdirFiles, root: Path) -> None:
    files.write("a/b/c/d.txt", b"deep")
    assert (root / "a" / "b" / "c" / "d.txt").read_bytes() == b"deep"
    assert files.read("./a//b/c/d.txt") == b"deep"


def test_write_replaces_an_existing_file(files: WorkdirFiles) -> None:
    files.write("f", b"first, longer")
    files.write("f", b"second")
    assert files.read("f") == b"second"


def test_write_leaves_no_temporary_files_behind(files: WorkdirFiles, root: Path) -> None:
    files.write("d/f", b"x")
    assert os.listdir(root / "d") == ["f"]


def test_write_replaces_a_hard_link_instead_of_writing_through_it(
    files: WorkdirFiles, root: Path, outside: Path
) -> None:
    os.link(outside / "secret.txt", root / "linked")
    files.write("linked", b"overwritten")
    assert files.read("linked") == b"overwritten"
    assert outside_untouched(outside)


def test_files_sent_by_the_sandbox_are_readable(files: WorkdirFiles, root: Path) -> None:
    (root / "made-inside.bin").write_bytes(bytes(range(256)))
    assert files.read("made-inside.bin") == bytes(range(256))


def test_files_of_exactly_the_limit_are_accepted(files: WorkdirFiles) -> None:
    files.write("full", b"x" * LIMIT_BYTES)
    assert files.read("full") == b"x" * LIMIT_BYTES


# Ownership and modes


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_created_files_and_directories_have_fixed_modes(files: WorkdirFiles, root: Path) -> None:
    old_umask = os.umask(0o077)
    try:
        files.write("a/b/f", b"x")
    finally:
        os.umask(old_umask)
    assert mode(root / "a") == mode(root / "a" / "b") == 0o755
    assert mode(root / "a" / "b" / "f") == 0o644


@as_root
def test_created_files_and_directories_belong_to_the_sandbox_user(root: Path) -> None:
    files = WorkdirFiles(root, SANDBOX_UID, SANDBOX_GID, max_file_bytes=LIMIT_BYTES)
    files.write("a/b/f", b"x")
    for path in (root / "a", root / "a" / "b", root / "a" / "b" / "f"):
        info = path.lstat()
        assert (info.st_uid, info.st_gid) == (SANDBOX_UID, SANDBOX_GID), path


@as_root
def test_existing_directories_keep_their_owner(root: Path) -> None:
    (root / "mine").mkdir()
    os.chown(root / "mine", 4242, 4242)
    WorkdirFiles(root, SANDBOX_UID, SANDBOX_GID, LIMIT_BYTES).write("mine/f", b"x")
    assert (root / "mine").lstat().st_uid == 4242
    assert (root / "mine" / "f").lstat().st_uid == SANDBOX_UID


def test_without_a_uid_files_keep_the_servers_owner(files: WorkdirFiles, root: Path) -> None:
    files.write("f", b"x")
    assert (root / "f").lstat().st_uid == os.geteuid()


# Paths


@pytest.mark.parametrize(
    ("given_path", "expected"),
    [
        ("a/b/c.txt", "a/b/c.txt"),
        ("./a//b", "a/b"),
        ("a/./b/", "a/b"),
        ("x", "x"),
        ("...", "..."),
        ("..a/b..", "..a/b.."),
        ("é/日本", "é/日本"),
        ("a\\..\\b", "a\\..\\b"),  # a backslash is an ordinary character on POSIX
    ],
)
def test_normalise_accepts_relative_paths(given_path: str, expected: str) -> None:
    assert normalise(given_path) == expected


@pytest.mark.parametrize(
    ("given_path", "reason"),
    [
        ("", "empty"),
        (".", "working directory itself"),
        ("./", "working directory itself"),
        ("/etc/passwd", "absolute"),
        ("//etc/passwd", "absolute"),
        ("..", "'..'"),
        ("../outside/secret.txt", "'..'"),
        ("a/../../outside", "'..'"),
        ("a/..", "'..'"),
        ("a\x00b", "NUL"),
        ("\udcff", "UTF-8"),
        ("a" * 256, "255 bytes"),
        ("é" * 128, "255 bytes"),  # 256 bytes in UTF-8
        ("a/" * 2048 + "a", "4096 bytes"),
    ],
)
def test_normalise_refuses(given_path: str, reason: str) -> None:
    with pytest.raises(PathRefused, match=reason):
        normalise(given_path)


def test_normalise_accepts_the_longest_names() -> None:
    assert normalise("a" * 255) == "a" * 255
    assert normalise("/".join(["a" * 255] * 16)) == "/".join(["a" * 255] * 16)  # 4095 bytes


PATHISH = st.lists(
    st.sampled_from(["a", "b", ".", "..", "", "/", "//", "\x00", "é", "\udcff", "...", "\\"]),
    max_size=12,
).map("".join)


@given(st.one_of(st.text(), PATHISH))
def test_normalised_paths_never_leave_the_root(relative: str) -> None:
    try:
        path = normalise(relative)
    except PathRefused:
        return
    root = "/nonexistent-cloche-root"
    resolved = os.path.realpath(os.path.join(root, path))
    assert resolved.startswith(root + "/")
    assert os.path.normpath(path) == path
    assert normalise(path) == path


def test_path_refused_is_a_session_error_that_says_why() -> None:
    with pytest.raises(SessionError, match=r"'\.\./x' refused: .*'\.\.'") as caught:
        normalise("../x")
    assert isinstance(caught.value, PathRefused)
    assert caught.value.path == "../x"


@pytest.mark.parametrize("bad", ["../outside/secret.txt", "/etc/passwd", "a/../../outside/x"])
def test_cant_escape_with_dotdot_or_absolute_paths(
    files: WorkdirFiles, outside: Path, bad: str
) -> None:
    with pytest.raises(PathRefused):
        files.read(bad)
    with pytest.raises(PathRefused):
        files.write(bad, b"pwned")
    assert outside_untouched(outside)


# Symlinks


def test_cant_read_through_a_final_symlink_to_outside(
    files: WorkdirFiles, root: Path, outside: Path
) -> None:
    os.symlink(outside / "secret.txt", root / "link")
    with pytest.raises(PathRefused, match="symlink"):
        files.read("link")


def test_cant_read_host_passwd_through_a_symlink(files: WorkdirFiles, root: Path) -> None:
    os.symlink("/etc/passwd", root / "passwd")
    with pytest.raises(PathRefused, match="symlink"):
        files.read("passwd")


def test_cant_read_through_a_relative_symlink(
    files: WorkdirFiles, root: Path, outside: Path
) -> None:
    os.symlink("../outside/secret.txt", root / "link")
    with pytest.raises(PathRefused, match="symlink"):
        files.read("link")


def test_cant_write_through_a_final_symlink_to_outside(
    files: WorkdirFiles, root: Path, outside: Path
) -> None:
    os.symlink(outside / "secret.txt", root / "link")
    os.symlink(outside / "new.txt", root / "dangling")
    with pytest.raises(PathRefused, match="symlink"):
        files.write("link", b"pwned")
    with pytest.raises(PathRefused, match="symlink"):
        files.write("dangling", b"pwned")
    assert outside_untouched(outside)
    assert os.readlink(root / "link") == str(outside / "secret.txt")


def test_cant_read_through_a_symlinked_directory(
    files: WorkdirFiles, root: Path, outside: Path
) -> None:
    os.symlink(outside, root / "dir")
    with pytest.raises(PathRefused, match="'dir' is a symlink"):
        files.read("dir/secret.txt")


def test_cant_write_through_a_symlinked_directory(
    files: WorkdirFiles, root: Path, outside: Path
) -> None:
    (root / "a").mkdir()
    os.symlink(outside, root / "a" / "dir")
    with pytest.raises(PathRefused, match="symlink"):
        files.write("a/dir/secret.txt", b"pwned")
    with pytest.raises(PathRefused, match="symlink"):
        files.write("a/dir/new/deeper.txt", b"pwned")
    assert outside_untouched(outside)


def test_cant_write_through_a_symlink_to_etc(files: WorkdirFiles, root: Path) -> None:
    os.symlink("/etc", root / "etc")
    with pytest.raises(PathRefused, match="symlink"):
        files.write("etc/cloche-pwned", b"pwned")
    assert not os.path.lexists("/etc/cloche-pwned")


def test_symlink_loops_are_refused(files: WorkdirFiles, root: Path) -> None:
    os.symlink("loop", root / "loop")
    with pytest.raises(PathRefused, match="symlink"):
        files.read("loop")
    with pytest.raises(PathRefused, match="symlink"):
        files.read("loop/x")
    with pytest.raises(PathRefused, match="symlink"):
        files.write("loop/x", b"x")


@pytest.fixture
def swapping(root: Path, outside: Path) -> Iterator[None]:
    """The sandbox flips root/d between a real directory and a symlink to outside."""
    (root / "real").mkdir()
    (root / "real" / "secret.txt").write_bytes(b"inside")
    os.symlink(outside, root / "evil")
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            for name in ("real", "evil"):
                with contextlib.suppress(OSError):  # the server may have made its own d
                    os.rename(root / name, root / "d")
                    os.rename(root / "d", root / name)

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        yield
    finally:
        stop.set()
        flipper.join()


@pytest.mark.usefixtures("swapping")
def test_a_directory_swapped_for_a_symlink_mid_walk_is_never_followed(
    files: WorkdirFiles, outside: Path
) -> None:
    outcomes: set[str] = set()
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        try:
            outcomes.add(files.read("d/secret.txt").decode())
        except PathNotFound:
            outcomes.add("not found")
        except PathRefused:
            outcomes.add("refused")
        try:
            files.write("d/new.txt", b"pwned")
        except PathRefused:
            pass
        files.list()
    assert SECRET.decode() not in outcomes
    assert outside_untouched(outside)


# Special files and sizes


@pytest.mark.timeout(10)
def test_reading_a_fifo_is_refused_without_blocking(files: WorkdirFiles, root: Path) -> None:
    os.mkfifo(root / "fifo")
    with pytest.raises(PathRefused, match="FIFO"):
        files.read("fifo")


@pytest.mark.timeout(10)
def test_a_fifo_swapped_in_after_the_check_is_refused_without_blocking(
    files: WorkdirFiles, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.mkfifo(root / "fifo")
    (root / "regular").write_bytes(b"x")
    regular = (root / "regular").lstat()
    monkeypatch.setattr(files_module, "_lstat", lambda parent, name: regular)
    with pytest.raises(PathRefused, match="FIFO"):
        files.read("fifo")


@pytest.mark.timeout(10)
def test_writing_over_a_fifo_is_refused_without_blocking(files: WorkdirFiles, root: Path) -> None:
    os.mkfifo(root / "fifo")
    with pytest.raises(PathRefused, match="FIFO"):
        files.write("fifo", b"x")
    assert stat.S_ISFIFO((root / "fifo").lstat().st_mode)


def test_directories_are_not_files(files: WorkdirFiles, root: Path) -> None:
    (root / "dir").mkdir()
    with pytest.raises(PathRefused, match="directory"):
        files.read("dir")
    with pytest.raises(PathRefused, match="directory"):
        files.write("dir", b"x")
    assert (root / "dir").is_dir()


def test_a_file_on_the_way_is_not_a_directory(files: WorkdirFiles, root: Path) -> None:
    (root / "file").write_bytes(b"x")
    with pytest.raises(PathRefused, match="'file' is not a directory"):
        files.read("file/x")
    with pytest.raises(PathRefused, match="not a directory"):
        files.write("file/x", b"x")


def test_missing_files_are_not_found(files: WorkdirFiles) -> None:
    with pytest.raises(PathNotFound):
        files.read("missing")
    with pytest.raises(PathNotFound):
        files.read("missing-dir/missing")


def test_reading_a_file_over_the_limit_is_refused(files: WorkdirFiles, root: Path) -> None:
    (root / "big").write_bytes(b"x" * (LIMIT_BYTES + 1))
    with pytest.raises(PathRefused, match="over the limit of 1024 bytes"):
        files.read("big")


def test_a_sparse_huge_file_is_refused_before_reading(files: WorkdirFiles, root: Path) -> None:
    with open(root / "sparse", "wb") as sparse:
        sparse.truncate(1 << 40)
    with pytest.raises(PathRefused, match="over the limit"):
        files.read("sparse")


def test_a_file_growing_past_the_limit_while_read_is_refused(
    files: WorkdirFiles, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (root / "growing").write_bytes(b"small")
    check = WorkdirFiles._check_readable
    checks: list[os.stat_result] = []

    def check_then_grow(self: WorkdirFiles, path: str, info: os.stat_result) -> None:
        check(self, path, info)
        checks.append(info)
        if len(checks) == 2:  # after lstat, then fstat of what was opened
            with open(root / "growing", "ab") as growing:
                growing.write(b"x" * LIMIT_BYTES)

    monkeypatch.setattr(WorkdirFiles, "_check_readable", check_then_grow)
    with pytest.raises(PathRefused, match="grew past the limit of 1024 bytes"):
        files.read("growing")


def test_writing_more_than_the_limit_is_refused(files: WorkdirFiles, root: Path) -> None:
    with pytest.raises(PathRefused, match="1025 bytes, over the limit"):
        files.write("big", b"x" * (LIMIT_BYTES + 1))
    assert os.listdir(root) == []


# Listing


def test_list_finds_every_regular_file_recursively(files: WorkdirFiles, root: Path) -> None:
    files.write("b.txt", b"bb")
    files.write("a/deep/c.txt", b"ccc")
    (root / "empty-dir").mkdir()
    listing = files.list()
    assert not listing.truncated
    assert [(f.path, f.size_bytes) for f in listing.files] == [
        ("a/deep/c.txt", 3),
        ("b.txt", 2),
    ]
    info = listing.files[1]
    assert isinstance(info, FileInfo)
    assert info.modified == pytest.approx((root / "b.txt").stat().st_mtime)


def test_list_skips_symlinks_and_special_files(
    files: WorkdirFiles, root: Path, outside: Path
) -> None:
    files.write("kept", b"x")
    os.symlink(outside / "secret.txt", root / "file-link")
    os.symlink("/etc/passwd", root / "passwd")
    os.symlink(outside, root / "dir-link")
    os.mkfifo(root / "fifo")
    assert [f.path for f in files.list().files] == ["kept"]


def test_list_survives_symlink_loops(files: WorkdirFiles, root: Path) -> None:
    (root / "a").mkdir()
    os.symlink("..", root / "a" / "up")
    os.symlink(".", root / "a" / "here")
    os.symlink("loop", root / "loop")
    files.write("a/f", b"x")
    assert [f.path for f in files.list().files] == ["a/f"]


def test_list_skips_names_no_client_could_name(files: WorkdirFiles, root: Path) -> None:
    os.close(os.open(os.fsencode(root) + b"/\xff\xfe", os.O_CREAT | os.O_WRONLY, 0o644))
    files.write("ok", b"x")
    assert [f.path for f in files.list().files] == ["ok"]


def test_list_stops_after_max_entries_and_says_so(files: WorkdirFiles, root: Path) -> None:
    for number in range(20):
        (root / f"f{number:02}").write_bytes(b"x")
    listing = files.list(max_entries=5)
    assert listing.truncated
    assert len(listing.files) == 5
    assert not files.list(max_entries=20).truncated


def test_list_stops_at_the_depth_limit_and_says_so(files: WorkdirFiles) -> None:
    deep = "/".join(["d"] * (files_module.MAX_WALK_DEPTH + 5))
    files.write(f"{deep}/f", b"x")
    files.write("shallow", b"x")
    listing = files.list()
    assert listing.truncated
    assert [f.path for f in listing.files] == ["shallow"]


# Snapshots


def test_changed_reports_created_and_modified_files_only(files: WorkdirFiles, root: Path) -> None:
    files.write("untouched", b"same")
    files.write("grown", b"x")
    files.write("touched", b"abc")
    files.write("deleted", b"x")
    before = files.snapshot()
    files.write("grown", b"xx")
    os.utime(root / "touched", ns=(0, 1_000_000_000))  # same size, new mtime
    files.write("new/file", b"x")
    (root / "deleted").unlink()
    os.symlink("untouched", root / "new-link")
    after = files.snapshot()
    assert changed(before, after) == ["grown", "new/file", "touched"]
    assert after["untouched"] == before["untouched"]


def test_snapshot_maps_paths_to_size_and_mtime_ns(files: WorkdirFiles, root: Path) -> None:
    files.write("d/f", b"12345")
    info = (root / "d" / "f").stat()
    assert files.snapshot() == {"d/f": (5, info.st_mtime_ns)}


def test_changed_between_identical_snapshots_is_empty(files: WorkdirFiles) -> None:
    files.write("f", b"x")
    assert changed(files.snapshot(), files.snapshot()) == []


def test_a_walk_records_how_many_entries_it_saw(files: WorkdirFiles, root: Path) -> None:
    # Sessions walk small working directories on the event loop and big ones in a thread,
    # by this count: directories count as well as files.
    assert files.last_walk_entries == 0
    files.write("a.txt", b"1")
    files.write("sub/b.txt", b"2")
    (root / "empty").mkdir()
    files.snapshot()
    assert files.last_walk_entries == 4  # a.txt, sub, sub/b.txt, empty
    files.list(max_entries=2)
    assert files.last_walk_entries == 3  # stopped at the third
