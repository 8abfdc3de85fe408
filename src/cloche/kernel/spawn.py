"""Starting a session's commands and terminals, and ending whole process trees.

A command leads a new session and process group of its own (as under E2B's envd), started
by posix_spawn: gVisor starts a process that way in ~15 ms where forking the supervisor
and then the command took ~60-130 ms (a fork copies the forking process's address space,
posix_spawn does not). The supervisor is root and single-threaded: it takes the user's
ids as its effective ones (keeping root as its saved uid), and the command's working
directory as its own, for the spawn only, so that the command starts as the user there.
Where that can't be done (a program not found, a directory not entered, a Python without
posix_spawn) the command starts the old way, which tells the command's stderr why: a
forked leader heads the session and forks the command. A command that calls `setsid`
itself forks away from its group (the `setsid` utility does when it leads one): use
`setsid -w` to keep its exit code. A terminal's shell leads its own session, with the
terminal as its controlling tty, as a login shell does.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import signal
import struct
import sys
import termios
from dataclasses import dataclass, field

# Signals the leader ignores, so that one sent to the group reaches the command and the
# leader reports the command's own answer to it (SIGKILL still ends both).
_LEADER_IGNORES = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGPIPE,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
)


@dataclass
class Identity:
    """Who a process runs as."""

    name: str
    uid: int
    gid: int
    home: str
    groups: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, name: str) -> Identity:
        """The identity of a user of the sandbox's /etc/passwd.

        Raises:
            KeyError: no such user.
        """
        entry = pwd.getpwnam(name)
        try:
            groups = os.getgrouplist(name, entry.pw_gid)
        except OSError:
            groups = [entry.pw_gid]
        return cls(name, entry.pw_uid, entry.pw_gid, entry.pw_dir or "/", groups)


@dataclass
class Start:
    """What to start: argv, where, with what, as whom."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    identity: Identity
    stdin: bool = False
    pty: tuple[int, int] | None = None  # (cols, rows) for a terminal


@dataclass
class Started:
    """A started process: its pid (the group's leader) and the supervisor's fds to it."""

    pid: int
    stdout: int  # for a terminal: the master, both ways
    stderr: int | None
    stdin: int | None


def start(what: Start) -> Started:
    """Fork and start `what`; the parent's fds are non-blocking and close-on-exec."""
    if what.pty is not None:
        return _start_terminal(what)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    in_r, in_w = os.pipe() if what.stdin else (os.open(os.devnull, os.O_RDONLY), -1)
    pid = _spawn(what, in_r, out_w, err_w)
    if pid is None:
        pid = _fork_leader(what, in_r, out_w, err_w)
    for fd in (out_w, err_w, in_r):
        os.close(fd)
    for fd in (out_r, err_r, in_w):
        if fd >= 0:
            os.set_blocking(fd, False)
    return Started(pid, out_r, err_r, in_w if in_w >= 0 else None)


def _spawn(what: Start, stdin: int, stdout: int, stderr: int) -> int | None:
    """posix_spawn the command as the user, in its working directory, leading its own
    session; None when that can't be done (then `_fork_leader` says why on its stderr)."""
    if not hasattr(os, "posix_spawn"):
        return None
    try:
        with _as(what.identity):
            os.chdir(what.cwd)
            program = _program(what.argv[0], what.env.get("PATH", os.defpath))
            if program is None:
                return None
            return os.posix_spawn(
                program,
                what.argv,
                what.env,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, stdin, 0),
                    (os.POSIX_SPAWN_DUP2, stdout, 1),
                    (os.POSIX_SPAWN_DUP2, stderr, 2),
                ],
                setsid=True,
                setsigdef=_DEFAULTED,
                setsigmask=(),
            )
    except (OSError, TypeError, ValueError):
        return None
    finally:
        os.chdir("/")


# Every signal a process may handle: posix_spawn sets them back to their defaults.
_DEFAULTED = tuple(
    number for number in signal.valid_signals() if number not in (signal.SIGKILL, signal.SIGSTOP)
)


class _as:  # noqa: N801  # a context manager, named for how it reads
    """The supervisor's effective ids (and groups) those of `who` for a while, root kept as
    the saved uid and gid to come back to; nothing where the supervisor already is `who`.

    Raises:
        PermissionError: the supervisor is not root and `who` is someone else.
    """

    def __init__(self, who: Identity) -> None:
        self.who = who
        self.switched = False

    def __enter__(self) -> None:
        who = self.who
        if who.uid == os.getuid() and who.gid == os.getgid():
            return
        if os.geteuid() != 0:
            raise PermissionError(who.name)
        self.groups = os.getgroups()
        self.switched = True
        try:
            os.setgroups(who.groups or [who.gid])
            os.setresgid(who.gid, who.gid, 0)
            os.setresuid(who.uid, who.uid, 0)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *_: object) -> None:
        if self.switched:
            os.setresuid(0, 0, 0)
            os.setresgid(0, 0, 0)
            os.setgroups(self.groups)


def _program(name: str, path: str) -> str | None:
    """The file execvp would run for name on path, executable by the (real) user."""
    if "/" in name:
        return name
    for directory in path.split(os.pathsep):
        candidate = os.path.join(directory or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _fork_leader(what: Start, stdin: int, stdout: int, stderr: int) -> int:
    """Fork a leader that heads a new session and forks the command (whose failure to start
    it reports on the command's stderr, with exit code 126 or 127)."""
    led_r, led_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _in_child(lambda: _lead(what, stdin, stdout, stderr, led_w))
    os.close(led_w)
    # Answered once the leader heads its session: a signal sent to the group right after
    # the start reaches the command, not a process still in the supervisor's group.
    os.read(led_r, 1)
    os.close(led_r)
    return pid


def _start_terminal(what: Start) -> Started:
    assert what.pty is not None
    master, slave = os.openpty()
    set_size(master, *what.pty)
    pid = os.fork()
    if pid == 0:

        def run() -> None:
            os.close(master)
            os.setsid()
            fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
            _become(what, slave, slave, slave)
            _exec(what)

        _in_child(run)
    os.close(slave)
    os.set_blocking(master, False)
    return Started(pid, master, None, master)


def set_size(fd: int, cols: int, rows: int) -> None:
    """Set a terminal's window size (the foreground group gets SIGWINCH)."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _lead(what: Start, stdin: int, stdout: int, stderr: int, led: int) -> None:
    os.setsid()
    for number in _LEADER_IGNORES:
        signal.signal(number, signal.SIG_IGN)
    os.write(led, b"!")
    _become(what, stdin, stdout, stderr)
    child = os.fork()
    if child == 0:
        _in_child(lambda: _exec(what))
    # The leader keeps no copy of the command's streams: their end is the command's.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            os._exit(127)
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        ended_by = os.WTERMSIG(status)
        signal.signal(ended_by, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [ended_by])
        os.kill(os.getpid(), ended_by)
        os._exit(128 + ended_by)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _become(what: Start, stdin: int, stdout: int, stderr: int) -> None:
    """In a child: the streams on 0, 1, 2, nothing else open, the user's identity, the cwd."""
    for target, fd in ((0, stdin), (1, stdout), (2, stderr)):
        if fd != target:
            os.dup2(fd, target)
    os.closerange(3, _max_fd())
    who = what.identity
    if os.getuid() == 0 and who.uid != 0:
        os.setgroups(who.groups or [who.gid])
        os.setgid(who.gid)
        os.setuid(who.uid)
    elif who.uid != os.getuid():
        raise PermissionError(f"cannot run as {who.name!r}: the sandbox has no root (--no-root)")
    try:
        os.chdir(what.cwd)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot enter the working directory {what.cwd!r}") from None


def _exec(what: Start) -> None:
    for number in range(1, signal.NSIG):
        try:
            if number not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    try:
        os.execvpe(what.argv[0], what.argv, what.env)  # noqa: S606  # argv, no shell
    except OSError as exc:
        os.write(2, f"cloche: cannot run {what.argv[0]!r}: {exc.strerror}\n".encode())
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)


def _in_child(body: object) -> None:
    """Run body in a forked child; never return to the supervisor's code."""
    try:
        body()  # type: ignore[operator]
    except BaseException as exc:  # noqa: BLE001  # reported on the command's stderr
        try:
            os.write(2, f"cloche: {exc}\n".encode())
        except OSError:
            pass
        os._exit(126)
    os._exit(0)


def _max_fd() -> int:
    try:
        return min(os.sysconf("SC_OPEN_MAX"), 1 << 16)
    except (OSError, ValueError):
        return 1024


# -- ending process trees ------------------------------------------------------------------


def _table() -> dict[int, tuple[int, int, int]]:
    """Every process of the sandbox: pid -> (ppid, pgid, sid), from /proc."""
    table: dict[int, tuple[int, int, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        table[int(name)] = (int(fields[1]), int(fields[2]), int(fields[3]))
    return table


def tree(pid: int, *, session: bool = True) -> set[int]:
    """pid, its descendants, the members of its process group and (with session) of its
    session: what a command started, even what left its group with `setsid`."""
    table = _table()
    found = {pid} if pid in table else set()
    for member, (_, pgid, sid) in table.items():
        if pgid == pid or (session and sid == pid):
            found.add(member)
    grew = True
    while grew:
        grew = False
        for member, (ppid, _, _) in table.items():
            if ppid in found and member not in found:
                found.add(member)
                grew = True
    found.discard(os.getpid())
    return found


def kill_tree(pid: int, number: int = signal.SIGKILL) -> int:
    """Stop every process of pid's tree, then send it number; how many were signalled."""
    stopped: set[int] = set()
    for _ in range(8):  # stop them first, so that none forks away meanwhile
        members = tree(pid) - stopped
        if not members:
            break
        for member in members:
            _signal(member, signal.SIGSTOP)
        stopped |= members
    for member in stopped:
        _signal(member, number)
        if number != signal.SIGKILL:
            _signal(member, signal.SIGCONT)
    return len(stopped)


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except (ProcessLookupError, PermissionError):
        pass


def exit_of(status: int) -> tuple[int | None, int | None]:
    """(exit code, None) or (None, signal number) from a wait status."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return (os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1), None


if sys.platform != "linux":  # pragma: no cover
    raise ImportError("the process supervisor runs on Linux only")
