"""A door's listening socket: a unix socket of the host in a sandbox's door directory."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path


def listen_at(path: Path, backlog: int) -> socket.socket:
    """A non-blocking unix socket listening at path (a stale socket there replaced), which
    the sandbox's user may connect to (only it sees the directory). A unix socket's path has
    room for ~107 bytes and deep state directories (a cluster node's) have longer ones, so
    it is bound through the directory's descriptor."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            listener.bind(f"/proc/self/fd/{directory}/{path.name}")
        finally:
            os.close(directory)
        os.chmod(path, 0o666)  # noqa: S103  # the sandbox's uid connects
        listener.listen(backlog)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    return listener
