"""The chrooted helper of template builds: lays a root filesystem tarball out in a directory,
and finishes a root filesystem (the user `user`, its home, /work), resolving every path
inside that directory.

It runs as a process of its own, as root: `python -I -S rootfs.py extract ARCHIVE ROOT` or
`... finish ROOT`. It opens what it needs, imports everything it will use, then chroots into
ROOT, so that no name from the image can reach the host: a symlink `etc -> /etc` followed by
a member `etc/passwd`, or an `/etc/passwd` that links to `/etc/shadow`, both resolve inside
ROOT. Member names and hardlink targets that lead out (`..`, absolute names) are refused
anyway, naming the member: an archive that tries is not an image.

Standard library only (it must run isolated, before any site-packages are trusted). Progress
goes to stdout as JSON lines (`{"progress": {...}}`, then `{"result": {...}}` for finish);
what is refused, skipped or failed goes to stderr, one line each. Exit status 0 when done,
1 when refused or failed, 2 for a usage error.
"""

from __future__ import annotations

import bz2  # noqa: F401  # tarfile imports its decompressors lazily: after the chroot,
import gzip  # noqa: F401  # nothing of the host's stdlib is reachable any more
import json
import lzma  # noqa: F401
import os
import re
import shutil
import stat
import sys
import tarfile
import time
import zlib  # noqa: F401
from typing import IO, Any

PROGRESS_EVERY_S = 0.5
COPY_BYTES = 1 << 20
USER = "user"
FIRST_UID = 1000
DEFAULT_PATH_DIRS = ("/usr/local/bin", "/usr/bin")
MIN_PYTHON_MINOR = 9  # cells run on the image's python3 from 3.9
# Member types laid out (devices are noted and skipped, and so is anything else).
_LAID = (
    *tarfile.REGULAR_TYPES,
    tarfile.DIRTYPE,
    tarfile.SYMTYPE,
    tarfile.LNKTYPE,
    tarfile.FIFOTYPE,
)
_Dirs = list[tuple[str, tarfile.TarInfo]]  # directories laid out, given owners and modes last


class Refused(Exception):
    """The archive asks for something a root filesystem may not: the member is named."""


def _say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _note(line: str) -> None:
    sys.stderr.write(line.replace("\n", " ") + "\n")
    sys.stderr.flush()


def _enter(root: str) -> None:
    """chroot into root: from here every path, and every symlink, resolves inside it."""
    os.chroot(root)
    os.chdir("/")
    os.umask(0)


def _inside(name: str, member: str, what: str = "member name") -> str:
    """name as an absolute path inside the root; Refused when it leads out."""
    if name.startswith("/"):
        raise Refused(f"member {member!r}: its {what} {name!r} is absolute (refused)")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused(f"member {member!r}: its {what} {name!r} has a '..' component (refused)")
    return "/" + "/".join(parts)


def _clear(path: str, keep_dir: bool) -> None:
    """Remove what is at path (never following it), unless it is a directory to keep."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        if not keep_dir:
            shutil.rmtree(path)
    else:
        os.unlink(path)


def _own(path: str, member: tarfile.TarInfo) -> None:
    """Numeric owner, then mode (a chown clears setuid bits), then mtime; links not chmodded."""
    os.lchown(path, member.uid, member.gid)
    if not member.issym():
        os.chmod(path, member.mode & 0o7777)
    os.utime(path, (member.mtime, member.mtime), follow_symlinks=False)


def _write(path: str, member: tarfile.TarInfo, tar: tarfile.TarFile) -> None:
    source = tar.extractfile(member)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "wb") as out:
        if source is not None:
            shutil.copyfileobj(source, out, COPY_BYTES)
        out.flush()
        os.fchown(fd, member.uid, member.gid)
        os.fchmod(fd, member.mode & 0o7777)
        os.utime(fd, (member.mtime, member.mtime))


def _lay(member: tarfile.TarInfo, tar: tarfile.TarFile, dirs: _Dirs) -> None:
    """Lay one member out (inside the chroot)."""
    path = _inside(member.name, member.name)
    if path == "/":
        return  # the root itself: its mode is the template's, not the archive's
    if member.ischr() or member.isblk():
        kind = "character" if member.ischr() else "block"
        _note(f"device node {member.name} ({kind} {member.devmajor},{member.devminor}) not created")
        return
    if member.type not in _LAID:
        _note(f"member {member.name}: type {member.type!r} skipped")
        return
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    _clear(path, keep_dir=member.isdir())
    if member.isdir():
        if not os.path.isdir(path):
            os.mkdir(path, 0o700)
        dirs.append((path, member))
    elif member.isreg():
        _write(path, member, tar)
    elif member.issym():
        os.symlink(member.linkname, path)
        _own(path, member)
    elif member.islnk():
        target = _inside(member.linkname, member.name, "hardlink target")
        try:
            os.link(target, path, follow_symlinks=False)
        except FileNotFoundError:
            raise Refused(
                f"member {member.name!r}: its hardlink target {member.linkname!r} is not in "
                "the archive before it"
            ) from None
    else:
        os.mkfifo(path, 0o600)
        _own(path, member)


def extract(archive: str, root: str) -> None:
    """Lay the tar archive (plain, gzip, bzip2 or xz) out in root, then set directories'
    owners, modes and times, deepest first."""
    source: IO[bytes] = open(archive, "rb")  # opened before the chroot, closed below
    total = os.fstat(source.fileno()).st_size
    _enter(root)
    dirs: _Dirs = []
    members = 0
    last = 0.0
    with source, tarfile.open(fileobj=source, mode="r|*") as tar:
        for member in tar:
            try:
                _lay(member, tar, dirs)
            except OSError as exc:
                raise Refused(f"member {member.name!r}: {exc.strerror or exc}") from exc
            members += 1
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                last = time.monotonic()
                _say(
                    progress={"read_bytes": source.tell(), "total_bytes": total, "members": members}
                )
    for path, member in sorted(dirs, key=lambda d: d[0], reverse=True):
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):  # not replaced by a later member
                _own(path, member)
        except FileNotFoundError:
            pass  # a later member removed it
    _say(progress={"read_bytes": total, "total_bytes": total, "members": members})


# -- finish -------------------------------------------------------------------------------


def _read_table(path: str) -> list[list[str]]:
    """The colon-separated lines of an /etc table; [] when it is missing."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return [line.rstrip("\n").split(":") for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _write_table(path: str, rows: list[list[str]], mode: int) -> None:
    """Replace the table by a new file (a rename: a symlink at path is replaced, not
    followed), keeping the old file's owner and mode when it had one."""
    uid = gid = 0
    try:
        info = os.lstat(path)
        if stat.S_ISREG(info.st_mode):
            uid, gid, mode = info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)
    except FileNotFoundError:
        pass
    temporary = path + ".cloche-new"
    _clear(temporary, keep_dir=False)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as out:
        out.write("".join(":".join(row) + "\n" for row in rows))
        os.fchown(out.fileno(), uid, gid)
        os.fchmod(out.fileno(), mode)
    os.replace(temporary, path)


def _shell() -> str | None:
    for shell in ("/bin/bash", "/bin/sh"):
        if os.path.isfile(shell) and os.access(shell, os.X_OK):
            return shell
    return None


def _add_user(shell: str | None) -> dict[str, Any]:
    """`user` as the image has it, or added to /etc/passwd, /etc/group and (when present)
    /etc/shadow and /etc/gshadow, locked; the rest of the image's /etc is kept."""
    if not os.path.isdir("/etc"):
        if os.path.lexists("/etc"):
            raise Refused("the image's /etc is not a directory")
        os.mkdir("/etc", 0o755)
    passwd = _read_table("/etc/passwd")
    for row in passwd:
        if row[0] == USER and len(row) >= 6 and row[2].isdigit() and row[3].isdigit():
            return {"name": USER, "uid": int(row[2]), "gid": int(row[3]), "home": row[5]}
    group = _read_table("/etc/group")
    uids = {int(r[2]) for r in passwd if len(r) > 2 and r[2].isdigit()}
    gids = {int(r[2]) for r in group if len(r) > 2 and r[2].isdigit()}
    uid = next(n for n in range(FIRST_UID, 1 << 31) if n not in uids and n not in gids)
    gid = next((int(r[2]) for r in group if r[0] == USER and len(r) > 2 and r[2].isdigit()), uid)
    home = "/home/" + USER
    if not passwd:
        passwd = [["root", "x", "0", "0", "root", "/root", shell or "/bin/sh"]]
    passwd.append([USER, "x", str(uid), str(gid), "", home, shell or "/bin/sh"])
    _write_table("/etc/passwd", passwd, 0o644)
    if not any(r[0] == USER for r in group):
        group = group or [["root", "x", "0", ""]]
        _write_table("/etc/group", [*group, [USER, "x", str(gid), ""]], 0o644)
    for table, row in (
        ("/etc/shadow", [USER, "!", "", "0", "99999", "7", "", "", ""]),
        ("/etc/gshadow", [USER, "!", "", ""]),
    ):
        rows = _read_table(table)
        if os.path.isfile(table) and not any(r[0] == USER for r in rows):
            _write_table(table, [*rows, row], 0o640)
    return {"name": USER, "uid": uid, "gid": gid, "home": home}


def _make_home(user: dict[str, Any]) -> None:
    """The user's home (0755, theirs) when missing, and /work -> it when /work is absent."""
    home = str(user["home"])
    if not os.path.lexists(home):
        # Resolved first: a /home that links elsewhere (inside the root) gets its target made.
        os.makedirs(os.path.realpath(os.path.dirname(home)), mode=0o755, exist_ok=True)
        os.mkdir(home, 0o755)
        os.chown(home, user["uid"], user["gid"])
    if not os.path.lexists("/work"):
        os.symlink(home, "/work")


def _minor(real: str) -> str | None:
    """The Y of a python3 binary at real: from its name python3.Y, or, for a binary named
    plain python3, from the one lib/python3.Y beside it."""
    found = re.fullmatch(r"python3\.(\d+)", os.path.basename(real))
    if found is not None:
        return found.group(1)
    if os.path.basename(real) != "python3":
        return None
    lib = os.path.join(os.path.dirname(os.path.dirname(real)), "lib")
    try:
        names = os.listdir(lib)
    except OSError:
        return None
    minors = [m.group(1) for n in names if (m := re.fullmatch(r"python3\.(\d+)", n))]
    return minors[0] if len(minors) == 1 else None


def _python() -> tuple[str | None, str | None]:
    """The image's python3 (≥ 3.9) and its X.Y, from names only: the `python3` in
    /usr/local/bin or /usr/bin resolved (inside the root), named python3.Y (or one
    lib/python3.Y beside it), with its stdlib at <prefix>/lib/python3.Y. Nothing of the
    image is run."""
    for directory in DEFAULT_PATH_DIRS:
        link = directory + "/python3"
        if not os.path.lexists(link):
            continue
        real = os.path.realpath(link)
        minor = _minor(real)
        if minor is None or not os.path.isfile(real):
            continue
        version = f"3.{minor}"
        prefix = os.path.dirname(os.path.dirname(real))
        if not os.path.isfile(f"{prefix}/lib/python{version}/os.py"):
            _note(f"{real}: no standard library at {prefix}/lib/python{version}; not used")
            continue
        if int(minor) < MIN_PYTHON_MINOR:
            _note(f"{real} is Python {version}, older than 3.{MIN_PYTHON_MINOR}; not used")
            continue
        return real, version
    return None, None


def _sweep() -> int:
    """Remove device nodes (an image's layers may carry them); the tree's size on disk."""
    seen: set[tuple[int, int]] = set()
    size = 0
    for top, dirs, files in os.walk("/"):
        for name in dirs + files:
            path = os.path.join(top, name)
            info = os.lstat(path)
            if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode):
                _note(f"device node {path} removed")
                os.unlink(path)
                continue
            if (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                size += info.st_blocks * 512
    return size


def finish(root: str) -> None:
    """Finish the root filesystem and print what a sandbox needs to know of it."""
    _enter(root)
    size = _sweep()
    shell = _shell()
    user = _add_user(shell)
    _make_home(user)
    python, version = _python()
    _say(
        result={
            "shell": shell,
            "python": python,
            "python_version": version,
            "user": user,
            "size_bytes": size,
        }
    )


def main(argv: list[str]) -> int:
    if (argv[:1], len(argv)) not in ((["extract"], 3), (["finish"], 2)):
        _note("usage: rootfs.py extract ARCHIVE ROOT | finish ROOT")
        return 2
    try:
        if argv[0] == "extract":
            extract(argv[1], argv[2])
        else:
            finish(argv[1])
    except Refused as exc:
        _note(str(exc))
        return 1
    except tarfile.TarError as exc:
        _note(f"not a tar archive cloche can read: {exc}")
        return 1
    except OSError as exc:
        _note(f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": "))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
