"""A session's whole filesystem, as one of its users: the verbs of E2B's Filesystem service.

The working directory's files (`list_files`, `read_file`, ...) are reached from the host;
these reach any path of the sandbox, inside it, as the user a request names (`user` by
default, `root` where the server allows it): the sandbox's supervisor does each operation
in a child that has taken that user's identity (`cloche.kernel.files`). Like the process
verbs, every manager has them; one that can't serve them says so (NotSupported).
"""

from __future__ import annotations

import abc
import base64
import binascii
import secrets
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from cloche.errors import Forbidden, NotSupported, PathNotFound, PathRefused
from cloche.sessions.processes import ProcessTable

WRITE_PIECE_BYTES = 1 << 20  # a write goes to the sandbox in frames of at most this much
# The supervisor kills an operation after 60 s (kernel/files.py) and answers: a loaded
# machine's sandbox (just restored, say) may take long to fork the operation's child.
ANSWER_WITHIN_S = 90.0


@dataclass(frozen=True)
class Entry:
    """A file, directory or symlink of the sandbox."""

    name: str
    type: str  # file, dir, other (a symlink is told by symlink_target)
    path: str
    size: int
    mode: int  # permission bits
    permissions: str  # as ls shows them: -rw-r--r--
    owner: str
    group: str
    modified_ns: int  # unix time, ns
    symlink_target: str | None = None

    @classmethod
    def of(cls, raw: Any) -> Entry:
        """An entry from the supervisor's answer (untrusted: checked).

        Raises:
            PathRefused: a malformed one.
        """
        if not isinstance(raw, Mapping):
            raise PathRefused("?", "the sandbox answered a malformed entry")
        try:
            target = raw.get("target")
            return cls(
                name=str(raw["name"]),
                type=str(raw["type"]),
                path=str(raw["path"]),
                size=int(raw["size"]),
                mode=int(raw["mode"]),
                permissions=str(raw["permissions"]),
                owner=str(raw["owner"]),
                group=str(raw["group"]),
                modified_ns=int(raw["modified_ns"]),
                symlink_target=str(target) if target is not None else None,
            )
        except (KeyError, TypeError, ValueError):
            raise PathRefused("?", "the sandbox answered a malformed entry") from None


async def ask(table: ProcessTable, user: str, do: str, path: str, **fields: Any) -> dict[str, Any]:
    """One operation of the supervisor's (`proc.fs`); its answer.

    Raises:
        PathNotFound: nothing at the path (ENOENT).
        PathRefused: refused (its errno is the exception's `code`), or a malformed answer.
    """
    reply = await table.request(
        "proc.fs", _timeout_s=ANSWER_WITHIN_S, user=user, do=do, path=path, **fields
    )
    code = reply.get("errno")
    if code is not None:
        message = str(reply.get("message") or code)
        if code == "ENOENT":
            raise PathNotFound(path)
        raise PathRefused(path, message, code=str(code))
    return reply


async def read_pieces(
    table: ProcessTable, user: str, path: str
) -> tuple[int, AsyncIterator[bytes]]:
    """A file's size and its content in pieces (the first read before this returns, so
    that a missing file raises here)."""
    first = await ask(table, user, "read", path, offset=0)
    size = int(first.get("size") or 0)

    async def pieces() -> AsyncIterator[bytes]:
        answer, offset = first, 0
        while True:
            try:
                data = base64.b64decode(str(answer.get("data") or ""), validate=True)
            except (binascii.Error, ValueError):
                raise PathRefused(path, "the sandbox answered a malformed piece") from None
            if data:
                yield data
            offset += len(data)
            if answer.get("eof") or not data:
                return
            answer = await ask(table, user, "read", path, offset=offset)

    return size, pieces()


async def write_pieces(
    table: ProcessTable, user: str, path: str, chunks: AsyncIterable[bytes]
) -> Entry:
    """Write a file from chunks, in frames of WRITE_PIECE_BYTES; its entry. The file is
    replaced only once all of it is there: a failure leaves what was there."""
    token = secrets.token_hex(8)
    buffer = bytearray()
    first = True
    try:
        async for chunk in chunks:
            buffer += chunk
            while len(buffer) > WRITE_PIECE_BYTES:
                piece = bytes(buffer[:WRITE_PIECE_BYTES])
                del buffer[:WRITE_PIECE_BYTES]
                await ask(table, user, "write", path, token=token, first=first, data=_b64(piece))
                first = False
        answer = await ask(
            table, user, "write", path, token=token, first=first, last=True, data=_b64(buffer)
        )
    except BaseException:
        if not first:
            try:
                await ask(table, user, "drop", path, token=token)
            except Exception:  # noqa: S110  # the sandbox may be gone: nothing to drop
                pass
        raise
    return Entry.of(answer.get("entry"))


def _b64(data: bytes | bytearray) -> str:
    return base64.b64encode(data).decode("ascii")


_NOT_HERE = "the sandbox's filesystem is not offered by this server (a cluster's front end)"


class FileVerbs(abc.ABC):  # noqa: B024  # every verb has a default: it says it can't
    """Any path of a session's sandbox, as a user (`user` by default; `root` is Forbidden
    with --no-root). All raise SessionNotFound for an unknown session or another owner's
    (a paused one is resumed first), PathNotFound when nothing is at the path, and
    PathRefused (with the errno as `code`) when the user may not or it can't be done."""

    async def fs_stat(
        self, session_id: str, path: str, *, user: str | None = None, owner: str | None = None
    ) -> Entry:
        """What is at path."""
        raise NotSupported(_NOT_HERE)

    async def fs_list(
        self,
        session_id: str,
        path: str,
        depth: int = 1,
        *,
        user: str | None = None,
        owner: str | None = None,
    ) -> list[Entry]:
        """A directory's entries, and theirs down to depth levels (at most 10,000)."""
        raise NotSupported(_NOT_HERE)

    async def fs_make_dir(
        self, session_id: str, path: str, *, user: str | None = None, owner: str | None = None
    ) -> tuple[bool, Entry]:
        """Make a directory and its parents: (whether it was made, its entry); (False,
        what is there) when something already was."""
        raise NotSupported(_NOT_HERE)

    async def fs_move(
        self,
        session_id: str,
        source: str,
        destination: str,
        *,
        user: str | None = None,
        owner: str | None = None,
    ) -> Entry:
        """Rename source to destination (its parents made); the entry there."""
        raise NotSupported(_NOT_HERE)

    async def fs_remove(
        self, session_id: str, path: str, *, user: str | None = None, owner: str | None = None
    ) -> None:
        """Remove a file, or a directory and all in it."""
        raise NotSupported(_NOT_HERE)

    async def fs_read(
        self, session_id: str, path: str, *, user: str | None = None, owner: str | None = None
    ) -> tuple[int, AsyncIterator[bytes]]:
        """A regular file's size and its content in pieces (read them to the end, or
        close the iterator)."""
        raise NotSupported(_NOT_HERE)

    async def fs_write(
        self,
        session_id: str,
        path: str,
        chunks: AsyncIterable[bytes],
        *,
        user: str | None = None,
        owner: str | None = None,
    ) -> Entry:
        """Create or replace a file (its parents made) from chunks; its entry. Until the
        last chunk is there, what was at path stays."""
        raise NotSupported(_NOT_HERE)


def check_user(user: str | None, root_allowed: bool) -> str:
    """The user an operation runs as.

    Raises:
        Forbidden: root, on a server with --no-root.
    """
    name = user or "user"
    if name == "root" and not root_allowed:
        raise Forbidden(
            "files may not be reached as root here: the server runs with --no-root (nothing "
            "in its sandboxes has uid 0)"
        )
    return name


class ForwardedFileVerbs(FileVerbs):
    """The file verbs of a manager that wraps another (`inner`): passed on as they are."""

    @property
    def _files(self) -> FileVerbs:
        inner: FileVerbs = getattr(self, "inner")  # noqa: B009  # the wrapper's own
        return inner

    async def fs_stat(self, *args: Any, **kwargs: Any) -> Entry:
        return await self._files.fs_stat(*args, **kwargs)

    async def fs_list(self, *args: Any, **kwargs: Any) -> list[Entry]:
        return await self._files.fs_list(*args, **kwargs)

    async def fs_make_dir(self, *args: Any, **kwargs: Any) -> tuple[bool, Entry]:
        return await self._files.fs_make_dir(*args, **kwargs)

    async def fs_move(self, *args: Any, **kwargs: Any) -> Entry:
        return await self._files.fs_move(*args, **kwargs)

    async def fs_remove(self, *args: Any, **kwargs: Any) -> None:
        await self._files.fs_remove(*args, **kwargs)

    async def fs_read(self, *args: Any, **kwargs: Any) -> tuple[int, AsyncIterator[bytes]]:
        return await self._files.fs_read(*args, **kwargs)

    async def fs_write(self, *args: Any, **kwargs: Any) -> Entry:
        return await self._files.fs_write(*args, **kwargs)
