"""Templates from images (sandbox/images.py and its chrooted helper) against the real tools:
a Debian tarball made by mmdebstrap, `docker import` then `docker save` of it, an OCI layout
by skopeo, an image of the Docker engine, a Dockerfile. Then the attacks: tarballs made with
tarfile whose members lead out, or lay symlinks for later members and for the finishing step
to follow, refused or contained; nothing reaches the host."""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil
import stat
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloche.sandbox.images import TemplateInfo, TemplateSource
from dockerd import docker
from images_support import build, make_tar, member, small_root, tree

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="building templates needs root (chroot)"),
]


def digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def assert_debian_template(info: TemplateInfo, rootfs: Path | None) -> None:
    """What a template of the Debian tarball must hold, whatever it was unpacked from."""
    assert rootfs is not None, info.error
    assert info.python == "/usr/bin/python3.11"
    assert info.python_version == "3.11"
    assert info.shell == "/bin/bash"
    assert info.user == {"name": "user", "uid": 1000, "gid": 1000, "home": "/home/user"}
    assert any(pair.startswith("PATH=") for pair in info.env)
    assert info.size_bytes > 100 << 20
    home = (rootfs / "home" / "user").lstat()
    assert stat.S_ISDIR(home.st_mode) and stat.S_IMODE(home.st_mode) == 0o755
    assert (home.st_uid, home.st_gid) == (1000, 1000)
    assert os.readlink(rootfs / "work") == "/home/user"
    assert "user:x:1000:1000::/home/user:/bin/bash" in (rootfs / "etc/passwd").read_text()
    assert "\nuser:x:1000:" in (rootfs / "etc/group").read_text()
    assert "\nuser:!:" in (rootfs / "etc/shadow").read_text()  # locked
    assert "\nroot:x:0:0:" in "\n" + (rootfs / "etc/passwd").read_text()  # the image's kept
    # The image's own python and a package only the image has (python3-yaml).
    assert (rootfs / "usr/lib/python3.11/os.py").is_file()
    assert (rootfs / "usr/lib/python3/dist-packages/yaml/__init__.py").is_file()
    assert (rootfs / "usr/bin/su").stat().st_mode & stat.S_ISUID  # kept: gVisor's to defuse
    devices = [
        p for p in tree(rootfs / "dev") if stat.S_ISCHR((rootfs / "dev" / p).lstat().st_mode)
    ]
    assert devices == []


# -- from each kind of source ---------------------------------------------------------------


def test_a_template_from_an_mmdebstrap_tarball(debian_tar: Path, tmp_path: Path) -> None:
    info, rootfs = build(TemplateSource("tar", str(debian_tar)), tmp_path / "work")
    assert_debian_template(info, rootfs)
    assert any("device node" in line and "not created" in line for line in info.log)


def test_a_template_from_an_oci_layout(debian_tar: Path, tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    subprocess.run(
        ["skopeo", "copy", f"tarball:{debian_tar}", f"oci:{layout}:v1"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    info, rootfs = build(TemplateSource("image", f"oci:{layout}:v1"), tmp_path / "work")
    assert_debian_template(info, rootfs)


@pytest.fixture(scope="module")
def imported(docker_daemon: None, debian_tar: Path) -> Iterator[str]:
    """The Debian tarball as an image of the Docker engine (`docker import`), removed after."""
    name = f"cloche-test-template:{uuid.uuid4().hex[:8]}"
    docker("import", str(debian_tar), name, timeout_s=300)
    yield name
    docker("image", "rm", "--force", name, check=False)


@pytest.mark.docker
def test_a_template_from_a_docker_save_archive(imported: str, tmp_path: Path) -> None:
    archive = tmp_path / "saved.tar"
    docker("save", "--output", str(archive), imported, timeout_s=300)
    info, rootfs = build(TemplateSource("image", f"docker-archive:{archive}"), tmp_path / "w")
    assert_debian_template(info, rootfs)


@pytest.mark.docker
def test_a_template_from_an_image_of_the_docker_engine(imported: str, tmp_path: Path) -> None:
    info, rootfs = build(TemplateSource("image", imported), tmp_path / "work")  # bare NAME:TAG
    assert_debian_template(info, rootfs)


@pytest.mark.docker
def test_a_template_from_a_dockerfile(imported: str, tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    (context / "greeting.txt").write_text("hello from the context\n")
    (context / "Dockerfile").write_text(
        f"FROM {imported}\n"
        "ENV GREETING=hello\n"
        "WORKDIR /srv\n"
        "COPY greeting.txt /srv/greeting.txt\n"
        "RUN echo built > /built.txt && python3 -c 'import yaml'\n"
    )
    source = TemplateSource("dockerfile", str(context / "Dockerfile"))
    info, rootfs = build(source, tmp_path / "work")
    assert_debian_template(info, rootfs)
    assert rootfs is not None
    assert (rootfs / "built.txt").read_text() == "built\n"
    assert (rootfs / "srv/greeting.txt").read_text() == "hello from the context\n"
    assert "GREETING=hello" in info.env
    assert info.working_dir == "/srv"
    assert any(line.startswith("Step 5/5") for line in info.log)
    # The build's image is gone again (and its intermediate layers with it).
    built = re.search(r"^Successfully built (\w+)$", "\n".join(info.log), re.MULTILINE)
    assert built is not None
    assert built.group(1) not in docker("images", "--quiet", "--all").split()
    assert docker("images", "--quiet", "cloche-template-build") == ""


@pytest.mark.docker
def test_a_dockerfile_that_fails_shows_dockers_own_lines(imported: str, tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text(f"FROM {imported}\nRUN echo about to fail && false\n")
    info, rootfs = build(TemplateSource("dockerfile", str(tmp_path / "Dockerfile")), tmp_path / "w")
    assert rootfs is None
    assert info.error is not None and info.error.startswith("docker build failed:")
    assert "about to fail" in "\n".join(info.log)
    assert docker("images", "--quiet", "cloche-template-build") == ""


def test_an_archive_that_is_not_an_image_shows_skopeos_own_line(tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not an archive at all")
    info, rootfs = build(TemplateSource("image", f"docker-archive:{junk}"), tmp_path / "work")
    assert rootfs is None
    assert info.error is not None and info.error.startswith("skopeo copy failed:")
    assert any(str(junk) in line for line in info.log)


# -- python3, found by its name --------------------------------------------------------------


def link(name: str, target: str, **attrs: object) -> tuple[tarfile.TarInfo, bytes]:
    return member(name, tarfile.SYMTYPE, linkname=target, **attrs)


def test_python3_is_found_through_its_links_with_its_stdlib(tmp_path: Path) -> None:
    archive = small_root(
        tmp_path / "root.tar",
        member("usr", tarfile.DIRTYPE),
        member("usr/local", tarfile.DIRTYPE),
        member("usr/local/bin", tarfile.DIRTYPE),
        member("usr/local/bin/python3.12", data=b"\x7fELF", mode=0o755),
        link("usr/local/bin/python3", "python3.12"),
        member("usr/local/lib", tarfile.DIRTYPE),
        member("usr/local/lib/python3.12", tarfile.DIRTYPE),
        member("usr/local/lib/python3.12/os.py"),
        member("usr/bin", tarfile.DIRTYPE),
        member("usr/bin/python3.8", data=b"\x7fELF", mode=0o755),
        link("usr/bin/python3", "/usr/bin/python3.8"),
    )
    info, _ = build(TemplateSource("tar", str(archive)), tmp_path / "work")
    assert (info.python, info.python_version) == ("/usr/local/bin/python3.12", "3.12")
    assert info.shell == "/bin/sh"


def test_a_python_older_than_3_9_or_without_stdlib_is_not_used(tmp_path: Path) -> None:
    archive = small_root(
        tmp_path / "root.tar",
        member("usr", tarfile.DIRTYPE),
        member("usr/bin", tarfile.DIRTYPE),
        member("usr/bin/python3.8", data=b"\x7fELF", mode=0o755),
        link("usr/bin/python3", "python3.8"),
        member("usr/lib", tarfile.DIRTYPE),
        member("usr/lib/python3.8", tarfile.DIRTYPE),
        member("usr/lib/python3.8/os.py"),
        member("usr/local", tarfile.DIRTYPE),
        member("usr/local/bin", tarfile.DIRTYPE),
        member("usr/local/bin/python3.11", data=b"\x7fELF", mode=0o755),
        link("usr/local/bin/python3", "python3.11"),  # no lib/python3.11 beside it
    )
    info, _ = build(TemplateSource("tar", str(archive)), tmp_path / "work")
    assert (info.python, info.python_version) == (None, None)
    assert any("older than 3.9" in line for line in info.log)
    assert any("no standard library" in line for line in info.log)


def test_a_python3_binary_named_plainly_is_known_by_its_lib(tmp_path: Path) -> None:
    archive = small_root(
        tmp_path / "root.tar",
        member("opt", tarfile.DIRTYPE),
        member("opt/py", tarfile.DIRTYPE),
        member("opt/py/bin", tarfile.DIRTYPE),
        member("opt/py/bin/python3", data=b"\x7fELF", mode=0o755),
        member("opt/py/lib", tarfile.DIRTYPE),
        member("opt/py/lib/python3.13", tarfile.DIRTYPE),
        member("opt/py/lib/python3.13/os.py"),
        member("usr", tarfile.DIRTYPE),
        member("usr/bin", tarfile.DIRTYPE),
        link("usr/bin/python3", "/opt/py/bin/python3"),
    )
    info, _ = build(TemplateSource("tar", str(archive)), tmp_path / "work")
    assert (info.python, info.python_version) == ("/opt/py/bin/python3", "3.13")


def test_a_gzipped_tarball_without_etc_gets_one_with_the_user(tmp_path: Path) -> None:
    plain = make_tar(tmp_path / "root.tar", [member("bin", tarfile.DIRTYPE)])
    packed = tmp_path / "root.tar.gz"
    with plain.open("rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    info, rootfs = build(TemplateSource("tar", str(packed)), tmp_path / "work")
    assert rootfs is not None, info.error
    assert info.shell is None
    assert (rootfs / "etc/passwd").read_text().splitlines() == [
        "root:x:0:0:root:/root:/bin/sh",
        "user:x:1000:1000::/home/user:/bin/sh",
    ]


def test_the_first_free_uid_is_taken_when_1000_is_someone_elses(tmp_path: Path) -> None:
    archive = make_tar(
        tmp_path / "root.tar",
        [
            member("etc", tarfile.DIRTYPE),
            member("etc/passwd", data=b"root:x:0:0::/root:/bin/sh\nnode:x:1000:1000::/n:/bin/sh\n"),
            member("etc/group", data=b"root:x:0:\nnode:x:1000:\nstaff:x:1001:\n"),
        ],
    )
    info, rootfs = build(TemplateSource("tar", str(archive)), tmp_path / "work")
    assert info.user == {"name": "user", "uid": 1002, "gid": 1002, "home": "/home/user"}
    assert rootfs is not None and (rootfs / "home/user").stat().st_uid == 1002


# -- attacks: refused, naming the member, or contained in the root ---------------------------


def refused(tmp_path: Path, *members: tuple[tarfile.TarInfo, bytes]) -> TemplateInfo:
    archive = small_root(tmp_path / "hostile.tar", *members)
    info, rootfs = build(TemplateSource("tar", str(archive)), tmp_path / "work")
    assert rootfs is None, "the hostile tarball was accepted"
    assert info.error is not None
    return info


def test_cant_lay_a_member_outside_with_dotdot(tmp_path: Path) -> None:
    info = refused(tmp_path, member("../x", data=b"pwned"))
    assert info.error == (
        "extract (cloche's rootfs helper) failed: member '../x': its member name '../x' has "
        "a '..' component (refused)"
    )
    assert info.log[-1] in info.error
    assert not (tmp_path / "x").exists() and not (tmp_path / "work" / "x").exists()


def test_cant_lay_a_member_at_an_absolute_name(tmp_path: Path) -> None:
    name = f"/tmp/cloche-test-{uuid.uuid4().hex}"
    info = refused(tmp_path, member(name, data=b"pwned"))
    assert f"member {name!r}: its member name {name!r} is absolute (refused)" in str(info.error)
    assert not Path(name).exists()


def test_cant_hardlink_outside_with_dotdot(tmp_path: Path) -> None:
    info = refused(tmp_path, member("pw", tarfile.LNKTYPE, linkname="../../etc/passwd"))
    assert "member 'pw': its hardlink target '../../etc/passwd' has a '..' component" in str(
        info.error
    )


def test_cant_hardlink_an_absolute_host_file(tmp_path: Path) -> None:
    before = os.stat("/etc/passwd").st_nlink
    info = refused(tmp_path, member("pw", tarfile.LNKTYPE, linkname="/etc/passwd"))
    assert "member 'pw': its hardlink target '/etc/passwd' is absolute" in str(info.error)
    assert os.stat("/etc/passwd").st_nlink == before


def test_a_symlink_to_an_absolute_dir_leads_later_members_inside_the_root(tmp_path: Path) -> None:
    name = f"cloche-test-{uuid.uuid4().hex}"
    archive = small_root(
        tmp_path / "root.tar",
        link("escape", "/etc"),
        member(f"escape/{name}", data=b"inside"),
    )
    info, rootfs = build(TemplateSource("tar", str(archive)), tmp_path / "work")
    assert rootfs is not None, info.error
    assert (rootfs / "etc" / name).read_text() == "inside"
    assert not Path("/etc", name).exists()


def test_a_symlink_etc_to_slash_etc_never_reaches_the_hosts_etc(tmp_path: Path) -> None:
    before = digest("/etc/passwd")
    archive = make_tar(
        tmp_path / "root.tar",
        [link("etc", "/etc"), member("etc/passwd", data=b"root::0:0::/:/bin/sh\n")],
    )
    info, rootfs = build(TemplateSource("tar", str(archive)), tmp_path / "work")
    # Inside the root, /etc -> /etc is a loop: the member has nowhere to go.
    assert rootfs is None
    assert "member 'etc/passwd'" in str(info.error)
    assert digest("/etc/passwd") == before


def test_the_finishing_step_never_writes_through_an_images_symlinks(tmp_path: Path) -> None:
    outside = tmp_path / "outside"  # a host directory the image's /home names
    outside.mkdir()
    shadow_before, passwd_before = digest("/etc/shadow"), digest("/etc/passwd")
    archive = make_tar(
        tmp_path / "root.tar",
        [
            member("etc", tarfile.DIRTYPE),
            member("etc/shadow", data=b"root:*:19000:0:99999:7:::\n", mode=0o640),
            link("etc/passwd", "/etc/shadow"),
            link("etc/group", "/etc/gshadow"),  # dangling, inside
            link("home", str(outside)),
            link("work", "/etc/passwd"),  # /work is taken: left as the image has it
        ],
    )
    info, rootfs = build(TemplateSource("tar", str(archive)), tmp_path / "work")
    assert rootfs is not None, info.error
    assert (digest("/etc/shadow"), digest("/etc/passwd")) == (shadow_before, passwd_before)
    assert list(outside.iterdir()) == []  # the home was made inside the root
    inside = rootfs / str(outside).lstrip("/") / "user"
    assert inside.is_dir() and inside.stat().st_uid == info.user["uid"]
    passwd = rootfs / "etc/passwd"
    assert not passwd.is_symlink() and passwd.read_text().endswith(":/home/user:/bin/sh\n")
    assert (rootfs / "etc/shadow").read_text().startswith("root:*:19000:")
    assert os.readlink(rootfs / "work") == "/etc/passwd"


def test_device_nodes_are_not_created(tmp_path: Path) -> None:
    archive = small_root(
        tmp_path / "root.tar",
        member("dev", tarfile.DIRTYPE),
        member("dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0),
        member("dev/mem", tarfile.CHRTYPE, devmajor=1, devminor=1),
    )
    info, rootfs = build(TemplateSource("tar", str(archive)), tmp_path / "work")
    assert rootfs is not None, info.error
    assert list((rootfs / "dev").iterdir()) == []
    assert "device node dev/mem (character 1,1) not created" in info.log


def test_setuid_bits_and_numeric_owners_are_kept(tmp_path: Path) -> None:
    archive = small_root(
        tmp_path / "root.tar",
        member("bin/su", data=b"\x7fELF", mode=0o4755, uid=0, gid=0),
        member("bin/mine", data=b"x", mode=0o2640, uid=4242, gid=4343),
        link("bin/link", "/nowhere", uid=4242, gid=4343),
    )
    info, rootfs = build(TemplateSource("tar", str(archive)), tmp_path / "work")
    assert rootfs is not None, info.error
    assert stat.S_IMODE((rootfs / "bin/su").stat().st_mode) == 0o4755
    mine = (rootfs / "bin/mine").stat()
    assert (stat.S_IMODE(mine.st_mode), mine.st_uid, mine.st_gid) == (0o2640, 4242, 4343)
    assert (rootfs / "bin/link").lstat().st_uid == 4242
