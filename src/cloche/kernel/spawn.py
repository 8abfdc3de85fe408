"""Starting a session's commands and terminals, and ending whole process trees.

A command runs under a leader that heads a new session and process group and waits for
it (as E2B's envd runs commands in a process of its own): the command itself is then never
a group leader, so a command that calls `setsid` itself (`setsid sh -c ...`, as agent
frameworks do) keeps its exit code and output. The leader passes the command's end on as
its own: the same exit code, or death by the same signal.

Leaders are forked ahead of their commands (`Spare`): in gVisor a fork of the supervisor
costs tens of ms (it copies an address space), which a start then no longer waits for. A
spare leader heads its session already; handed a command (its streams passed over a unix
socket), it becomes the user and starts the command by posix_spawn (~15 ms here: nothing
is copied). A terminal's shell leads its own session, with the terminal as its
controlling tty, as a login shell does.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import signal
import socket
import struct
import sys
import termios
import time

TYPE_CHECKING = False  # typing is not imported: the supervisor stays small
if TYPE_CHECKING:
    from typing import Any

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


# Plain classes, not dataclasses: `dataclasses` brings `inspect` and `ast` with it, and
# the supervisor's every imported byte is saved in each of the session's checkpoints.
class Identity:
    """Who a process runs as."""

    __slots__ = ("name", "uid", "gid", "home", "groups")

    def __init__(self, name: str, uid: int, gid: int, home: str, groups: list[int]) -> None:
        self.name = name
        self.uid = uid
        self.gid = gid
        self.home = home
        self.groups = groups

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


class Start:
    """What to start: argv, where, with what, as whom; pty (cols, rows) for a terminal."""

    __slots__ = ("argv", "cwd", "env", "identity", "stdin", "pty")

    def __init__(
        self,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        identity: Identity,
        stdin: bool = False,
        pty: tuple[int, int] | None = None,
    ) -> None:
        self.argv = argv
        self.cwd = cwd
        self.env = env
        self.identity = identity
        self.stdin = stdin
        self.pty = pty


class Started:
    """A started process: its pid (the group's leader) and the supervisor's fds to it
    (stdout, for a terminal: the master, both ways)."""

    __slots__ = ("pid", "stdout", "stderr", "stdin")

    def __init__(self, pid: int, stdout: int, stderr: int | None, stdin: int | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.stdin = stdin


def start(what: Start, spare: Spare | None = None) -> Started:
    """Start `what` under spare (or a leader forked now); the parent's fds are
    non-blocking and close-on-exec."""
    if what.pty is not None:
        return _start_terminal(what)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    in_r, in_w = os.pipe() if what.stdin else (os.open(os.devnull, os.O_RDONLY), -1)
    try:
        if spare is None or not spare.lead(what, (in_r, out_w, err_w)):
            spare = Spare()
            if not spare.lead(what, (in_r, out_w, err_w)):
                raise OSError("the command's leader could not be started")
    except BaseException:
        for fd in (out_r, err_r, in_w):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        for fd in (out_w, err_w, in_r):
            os.close(fd)
    pid = spare.pid
    for fd in (out_r, err_r, in_w):
        if fd >= 0:
            os.set_blocking(fd, False)
    return Started(pid, out_r, err_r, in_w if in_w >= 0 else None)


class Spare:
    """A leader forked before its command: it heads a new session of its own and ignores
    the signals the group gets, then waits to be handed a command (`lead`)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:
            ours.close()
            _in_child(lambda: _wait_to_lead(theirs))
        theirs.close()
        self.link = ours

    def lead(self, what: Start, streams: tuple[int, int, int]) -> bool:
        """Hand it `what` and the command's stdin, stdout and stderr; False if it is gone
        (killed meanwhile). Either way the spare is used up."""
        who = what.identity
        spec = {
            "argv": what.argv,
            "cwd": what.cwd,
            "env": what.env,
            "identity": [who.name, who.uid, who.gid, who.home, who.groups],
        }
        body = json.dumps(spec, ensure_ascii=False).encode("utf-8", "surrogateescape")
        try:
            # Once it heads its session (its byte): a signal sent to the group right after
            # the start reaches the command, never a process in the supervisor's group.
            if self.link.recv(1) != b"!":
                return False
            socket.send_fds(self.link, [body], list(streams))
            return True
        except OSError:
            return False
        finally:
            self.link.close()

    def discard(self) -> None:
        """Let it go unused (it exits once its link closes)."""
        self.link.close()


def _wait_to_lead(link: socket.socket) -> None:
    """A spare leader's life: head a session, wait for a command, lead it."""
    signal.set_wakeup_fd(-1)  # the supervisor's: never this process's
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    for number in _LEADER_IGNORES:
        signal.signal(number, signal.SIG_IGN)
    keep = link.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, _max_fd())
    link.sendall(b"!")
    body, fds, _, _ = socket.recv_fds(link, 1 << 24, 3)
    if not body or len(fds) != 3:
        os._exit(0)  # discarded, or the supervisor has gone
    spec = json.loads(body.decode("utf-8", "surrogateescape"))
    name, uid, gid, home, groups = spec["identity"]
    what = Start(spec["argv"], spec["cwd"], spec["env"], Identity(name, uid, gid, home, groups))
    stdin, stdout, stderr = fds
    _lead(what, stdin, stdout, stderr, open_fds=(keep, stdin, stdout, stderr))


# Every signal a process may handle: posix_spawn sets them back to their defaults.
_DEFAULTED = tuple(
    number for number in signal.valid_signals() if number not in (signal.SIGKILL, signal.SIGSTOP)
)


def _program(name: str, path: str) -> str | None:
    """The file execvp would run for name on path, executable by the (real) user."""
    if "/" in name:
        return name
    for directory in path.split(os.pathsep):
        candidate = os.path.join(directory or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


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


def _lead(
    what: Start, stdin: int, stdout: int, stderr: int, open_fds: tuple[int, ...] | None = None
) -> None:
    """As a session's leader: start the command as the user, wait for it, end as it did."""
    _become(what, stdin, stdout, stderr, open_fds)
    child = _spawn(what)
    if child is None:  # it can't be spawned: a forked child says why, on its stderr
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


def _spawn(what: Start) -> int | None:
    """posix_spawn the command (its streams, ids and directory are the caller's); None
    when it can't be (no such program, or a Python without posix_spawn)."""
    program = _program(what.argv[0], what.env.get("PATH", os.defpath))
    if program is None or not hasattr(os, "posix_spawn"):
        return None
    try:
        return os.posix_spawn(program, what.argv, what.env, setsigdef=_DEFAULTED, setsigmask=())
    except (OSError, TypeError, ValueError):
        return None


def _become(
    what: Start, stdin: int, stdout: int, stderr: int, open_fds: tuple[int, ...] | None = None
) -> None:
    """In a child: the streams on 0, 1, 2, nothing else open (open_fds: all that is, if
    known: closing every possible fd one by one costs gVisor milliseconds), the user's
    identity, the cwd."""
    for target, fd in ((0, stdin), (1, stdout), (2, stderr)):
        if fd != target:
            os.dup2(fd, target)
    if open_fds is None:
        os.closerange(3, _max_fd())
    else:
        for fd in set(open_fds) - {0, 1, 2}:
            os.close(fd)
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


WINDOW = 256 * 1024  # output bytes of one process sent and not yet acknowledged, at most


class Running:
    """A process the supervisor started: its streams, its input waiting, its output owed."""

    def __init__(self, started: Started, request: dict[str, Any]) -> None:
        self.pid = started.pid
        self.outputs: dict[int, int] = {started.stdout: 1}  # read fd -> stream number
        if started.stderr is not None:
            self.outputs[started.stderr] = 2
        self.stdin = started.stdin  # for a terminal, its master (also its output)
        self.terminal = request.get("pty") is not None
        self.pending_input = b""
        self.close_input = False  # close stdin once the pending input is written
        self.unacked = 0
        self.status: int | None = None  # wait status, once the leader is reaped
        self.described = {
            "pid": self.pid,
            "cmd": request.get("cmd"),
            "argv": request.get("argv"),
            "cwd": request.get("cwd"),
            "env": request.get("env"),
            "tag": request.get("tag"),
            "user": request.get("user"),
            "pty": self.terminal,
            "stdin": bool(request.get("stdin")) or self.terminal,
            "started_at": time.time(),
        }

    @property
    def paused(self) -> bool:
        """Its output waits for the host's acknowledgement (not once it has ended)."""
        return self.unacked >= WINDOW and self.status is None


if sys.platform != "linux":  # pragma: no cover
    raise ImportError("the process supervisor runs on Linux only")
