"""Files of the sandbox as one of its users: stat, list, make, move, remove, read, write.

The process supervisor (`procd`) answers these for front ends that act on the sandbox's
files "as the user the request names" (E2B's Filesystem service and `/files`). Each one runs
in a short-lived child forked for it, which takes the user's identity first (its effective
ids), so what the user may not touch is refused by the kernel's own checks; only the
directories an operation makes where the user may not (E2B clients make their workspace
at the top level, as envd allows) are made by root and given to the user. The answer
comes back over a pipe, bounded: a listing at most MAX_ENTRIES entries, a read at most
PIECE_BYTES; an operation that takes longer than DEADLINE_S is killed.

    host -> supervisor  {"op": "proc.fs", "rid", "user", "do": "stat" | "list" | "mkdir" |
                          "move" | "remove" | "read" | "write" | "drop", ...its fields}
    supervisor -> host  {"op": "proc.reply", "rid", ...result}
                        or {"op": "proc.reply", "rid", "errno": "ENOENT", "message": str}

A write goes to a hidden file beside its target, piece by piece, and replaces the target
only with its last piece (`last`): a write that fails or is dropped leaves the target as it
was.
"""

from __future__ import annotations

import base64
import errno
import grp
import json
import os
import pwd
import select
import signal
import stat
import time

from . import spawn

TYPE_CHECKING = False  # typing is not imported: the supervisor stays small
if TYPE_CHECKING:
    from typing import Any

PIECE_BYTES = 1 << 20  # a read answers at most this much
MAX_ENTRIES = 10_000  # a listing answers at most this many entries
DEADLINE_S = 60.0  # an operation still running after this is killed
_TYPES = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Do one operation as the user it names, in a child; its answer."""
    user = str(request.get("user") or "user")
    try:
        who = spawn.Identity.of(user)
    except KeyError:
        return {"errno": "EPERM", "message": f"no user {user!r} in the sandbox's /etc/passwd"}
    if os.getuid() != 0 and who.uid != os.getuid():
        return {"errno": "EPERM", "message": f"cannot act as {user!r}: the sandbox has no root"}
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become the user, do it, answer, leave
        os.close(read_end)
        answer = _answer(request, who)
        body = json.dumps(answer, ensure_ascii=False).encode("utf-8", "surrogateescape")
        view = memoryview(body)
        while view:
            view = view[os.write(write_end, view) :]
        os._exit(0)
    os.close(write_end)
    said = _read_all(read_end, pid)
    os.waitpid(pid, 0)
    if said is None:
        return {"errno": "ETIMEDOUT", "message": f"the operation took over {DEADLINE_S:g} s"}
    try:
        reply: dict[str, Any] = json.loads(said)
    except ValueError:
        return {"errno": "EIO", "message": "the operation ended without an answer"}
    return reply


def _read_all(fd: int, pid: int) -> bytes | None:
    """What the child writes until it closes the pipe; None if it is killed for its time."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + DEADLINE_S
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def _answer(request: dict[str, Any], who: spawn.Identity) -> dict[str, Any]:
    try:
        if os.getuid() == 0 and who.uid != 0:  # effective ids only: see _make_dirs
            os.setgroups(who.groups or [who.gid])
            os.setegid(who.gid)
            os.seteuid(who.uid)
        os.environ["HOME"] = who.home
        return _OPS[str(request.get("do"))](request, who)
    except KeyError:
        return {"errno": "EINVAL", "message": f"unknown operation {request.get('do')!r}"}
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, "EIO")
        where = f": {exc.filename}" if exc.filename else ""
        return {"errno": code, "message": f"{exc.strerror or code}{where}"}
    except (TypeError, ValueError) as exc:
        return {"errno": "EINVAL", "message": str(exc)}


def _path(request: dict[str, Any], who: spawn.Identity, key: str = "path") -> str:
    """An absolute path: relative ones are taken from the user's home, as envd does."""
    path = request.get(key)
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"{key} must be a non-empty path")
    path = os.path.expanduser(path)
    return os.path.normpath(os.path.join(who.home, path))


def _entry(path: str) -> dict[str, Any]:
    info = os.lstat(path)
    kind = _TYPES.get(stat.S_IFMT(info.st_mode), "other")
    entry: dict[str, Any] = {
        "name": os.path.basename(path) or "/",
        "type": kind,
        "path": path,
        "size": info.st_size,
        "mode": stat.S_IMODE(info.st_mode),
        "permissions": stat.filemode(info.st_mode),
        "owner": _name(pwd.getpwuid, info.st_uid),
        "group": _name(grp.getgrgid, info.st_gid),
        "modified_ns": info.st_mtime_ns,
    }
    if kind == "symlink":
        entry["target"] = os.path.realpath(path)
        try:
            target = os.stat(path)
            entry["type"] = _TYPES.get(stat.S_IFMT(target.st_mode), "other")
            entry["symlink"] = True
        except OSError:
            pass
    return entry


def _name(lookup: Any, number: int) -> str:
    try:
        return str(lookup(number)[0])
    except KeyError:
        return str(number)


def _stat(request: dict[str, Any], who: spawn.Identity) -> dict[str, Any]:
    return {"entry": _entry(_path(request, who))}


def _list(request: dict[str, Any], who: spawn.Identity) -> dict[str, Any]:
    top = _path(request, who)
    depth = max(1, int(request.get("depth") or 1))
    if not stat.S_ISDIR(os.stat(top).st_mode):
        raise OSError(errno.ENOTDIR, "Not a directory", top)
    entries: list[dict[str, Any]] = []
    level = [top]
    for _ in range(depth):
        deeper = []
        for where in level:
            try:
                names = sorted(os.listdir(where))
            except OSError:
                if where == top:
                    raise
                continue
            for name in names:
                if len(entries) >= MAX_ENTRIES:
                    return {"entries": entries, "truncated": True}
                try:
                    entry = _entry(os.path.join(where, name))
                except OSError:
                    continue
                entries.append(entry)
                if entry["type"] == "dir" and not entry.get("symlink"):
                    deeper.append(entry["path"])
        level = deeper
    return {"entries": entries}


def _make_dirs(path: str, who: spawn.Identity) -> None:
    """Make path and its parents as the user; where the user may not (a top-level
    directory), as envd does: made by root and given to the user (not with --no-root)."""
    try:
        os.makedirs(path, exist_ok=True)
        return
    except PermissionError:
        if os.getuid() != 0:
            raise
    missing = []
    where = path
    while not os.path.lexists(where):
        missing.append(where)
        where = os.path.dirname(where)
    uid, gid = os.geteuid(), os.getegid()
    os.seteuid(0)
    os.setegid(0)
    try:
        for made in reversed(missing):
            os.mkdir(made, 0o755)
            os.chown(made, who.uid, who.gid)
    finally:
        os.setegid(gid)
        os.seteuid(uid)


def _mkdir(request: dict[str, Any], who: spawn.Identity) -> dict[str, Any]:
    path = _path(request, who)
    if os.path.lexists(path):
        return {"exists": True, "entry": _entry(path)}
    _make_dirs(path, who)
    return {"exists": False, "entry": _entry(path)}


def _move(request: dict[str, Any], who: spawn.Identity) -> dict[str, Any]:
    source, destination = _path(request, who, "source"), _path(request, who, "destination")
    os.lstat(source)  # ENOENT before anything is made
    _make_dirs(os.path.dirname(destination), who)
    os.rename(source, destination)
    return {"entry": _entry(destination)}


def _remove(request: dict[str, Any], who: spawn.Identity) -> dict[str, Any]:
    path = _path(request, who)
    if stat.S_ISDIR(os.lstat(path).st_mode):
        import shutil  # only here: it weighs on the supervisor's every checkpoint

        shutil.rmtree(path)
    else:
        os.unlink(path)
    return {}


def _read(request: dict[str, Any], who: spawn.Identity) -> dict[str, Any]:
    path = _path(request, who)
    offset = max(0, int(request.get("offset") or 0))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO does not hold us up
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise OSError(errno.EISDIR, "Is a directory", path)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "Not a regular file", path)
        data = os.pread(fd, PIECE_BYTES, offset)
    finally:
        os.close(fd)
    return {
        "data": base64.b64encode(data).decode("ascii"),
        "size": info.st_size,
        "eof": offset + len(data) >= info.st_size or not data,
    }


def _hidden(path: str, token: str) -> str:
    if not token.isalnum():
        raise ValueError("a write's token is letters and digits")
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.cloche-{token}")


def _write(request: dict[str, Any], who: spawn.Identity) -> dict[str, Any]:
    path = _path(request, who)
    hidden = _hidden(path, str(request.get("token") or ""))
    data = base64.b64decode(str(request.get("data") or ""), validate=True)
    if request.get("first"):
        if os.path.isdir(path):
            raise OSError(errno.EISDIR, "Is a directory", path)
        _make_dirs(os.path.dirname(path), who)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    else:
        flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW
    fd = os.open(hidden, flags, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        os.close(fd)
        os.unlink(hidden)
        raise
    os.close(fd)
    if not request.get("last"):
        return {}
    try:
        os.chmod(hidden, stat.S_IMODE(os.stat(path).st_mode))
    except OSError:
        pass
    os.rename(hidden, path)
    return {"entry": _entry(path)}


def _drop(request: dict[str, Any], who: spawn.Identity) -> dict[str, Any]:
    try:
        os.unlink(_hidden(_path(request, who), str(request.get("token") or "")))
    except FileNotFoundError:
        pass
    return {}


_OPS = {
    "stat": _stat,
    "list": _list,
    "mkdir": _mkdir,
    "move": _move,
    "remove": _remove,
    "read": _read,
    "write": _write,
    "drop": _drop,
}
