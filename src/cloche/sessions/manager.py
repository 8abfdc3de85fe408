"""The session manager: the one interface every front end uses to reach sessions.

`SessionManager` is abstract so that sessions can live elsewhere (restored from
checkpoints, spread over machines). The manager of one machine is built in layers, one
module each: `sessions.core` (live sessions: find, list, close, expire),
`sessions.mounts` (volumes, and mounting them into sessions' sandboxes),
`sessions.creation` (making one), `sessions.running` (cells, history, packages, files),
`sessions.durability` (pause, resume, restart), `sessions.copies` (snapshots, forks),
`sessions.moving` (the verbs a cluster moves sessions with) and `sessions.local`
(`LocalSessionManager`: its life, from taking over a data directory to shutdown). The
cluster's is `cloche.cluster.manager`.
"""

from __future__ import annotations

import abc
import asyncio
import builtins
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, Mapping, Sequence
from typing import Any

from cloche.errors import (
    InvalidEnvironment,
    InvalidMetadata,
    NodeNotFound,
    NotSupported,
    PackageInstallError,
    TemplateNotFound,
)
from cloche.sandbox.images import TemplateInfo, TemplateSource
from cloche.sandbox.listing import FileListing
from cloche.sessions.commands import ProcessVerbs
from cloche.sessions.doors import EgressAsk
from cloche.sessions.filesystem import FileVerbs
from cloche.sessions.history import CellEntry
from cloche.sessions.kernel import EventCallback
from cloche.sessions.ports import PortVerbs
from cloche.sessions.result import CellResult
from cloche.sessions.session import SessionInfo
from cloche.sessions.store import SnapshotRecord
from cloche.sessions.templates import BUILT_IN, python_template
from cloche.sessions.volumes import VolumeVerbs

__all__ = ["EgressAsk", "InstalledPackages", "SessionManager", "new_session_id"]

InstalledPackages = list[dict[str, str]]  # [{"name", "version"}]
READ_PIECE_BYTES = 1 << 20  # a file is read for a download in pieces of this size at most
METADATA_MAX_PAIRS = 32
METADATA_MAX_BYTES = 4096  # keys and values together, UTF-8
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TEMPLATES_HERE_ONLY = (
    "templates are built per machine and not yet offered over a cluster (--cluster); "
    "build and use them on a server without --cluster"
)


def new_session_id() -> str:
    """A random UUID (122 bits from the OS's CSPRNG): unguessable, safe in URLs and file
    names, and the shape jupyter_server's routes require of a kernel id (it is one)."""
    return str(uuid.uuid4())


def check_metadata(
    metadata: Mapping[str, Any], changes: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """metadata with changes merged (a None value deletes its key), checked: string keys
    and values, at most METADATA_MAX_PAIRS pairs and METADATA_MAX_BYTES in all.

    Raises:
        InvalidMetadata: it is not.
    """
    if not isinstance(metadata, Mapping) or not isinstance(changes or {}, Mapping):
        raise InvalidMetadata("metadata is an object of string keys and string values")
    merged = dict(metadata)
    for key, value in (changes or {}).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    for key, value in merged.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key:
            raise InvalidMetadata(
                f"metadata {key!r}: keys are non-empty strings and values strings "
                "(null in a PATCH deletes a key)"
            )
    if len(merged) > METADATA_MAX_PAIRS:
        raise InvalidMetadata(
            f"metadata has {len(merged)} pairs; a session keeps at most {METADATA_MAX_PAIRS}"
        )
    size = sum(len(k.encode()) + len(v.encode()) for k, v in merged.items())
    if size > METADATA_MAX_BYTES:
        raise InvalidMetadata(
            f"metadata holds {size} bytes; a session keeps at most {METADATA_MAX_BYTES}"
        )
    return merged


ENV_MAX_PAIRS = 256
ENV_MAX_BYTES = 128 * 1024  # names and values together, UTF-8


def check_env(env: Mapping[str, Any]) -> dict[str, str]:
    """Environment variables for a session, checked: names of letters, digits and _ (not
    starting with a digit), string values without NUL, within ENV_MAX_PAIRS and
    ENV_MAX_BYTES.

    Raises:
        InvalidEnvironment: they are not.
    """
    if not isinstance(env, Mapping):
        raise InvalidEnvironment("env is an object of variable names and string values")
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise InvalidEnvironment(
                f"env {name!r}: a variable's name is letters, digits and _, not starting "
                "with a digit"
            )
        if not isinstance(value, str) or "\0" in value:
            raise InvalidEnvironment(f"env {name!r}: its value must be a string without NUL")
    if len(env) > ENV_MAX_PAIRS:
        raise InvalidEnvironment(f"env has {len(env)} variables; at most {ENV_MAX_PAIRS}")
    size = sum(len(k.encode()) + len(v.encode()) for k, v in env.items())
    if size > ENV_MAX_BYTES:
        raise InvalidEnvironment(f"env holds {size} bytes; at most {ENV_MAX_BYTES}")
    return dict(env)


def matches(
    info: SessionInfo,
    state: str | None = None,
    profile: str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> bool:
    """Whether a session is in the state, of the profile, and carries every pair given."""
    if state is not None and info.state.value != state:
        return False
    if profile is not None and info.profile != profile:
        return False
    return all(info.metadata.get(k) == v for k, v in (metadata or {}).items())


class SessionManager(ProcessVerbs, FileVerbs, PortVerbs, VolumeVerbs, abc.ABC):
    """Creates, finds, runs, expires and closes sessions."""

    @abc.abstractmethod
    async def create(
        self,
        owner: str | None = None,
        profile: str = "lean",
        snapshot: str | None = None,
        egress: EgressAsk = None,
        metadata: Mapping[str, str] | None = None,
        cell_timeout_s: float | None = None,
        template: str | None = None,
        env: Mapping[str, str] | None = None,
        volumes: Sequence[Mapping[str, Any]] | None = None,
    ) -> SessionInfo:
        """A new session of a profile (`lean` or `data`) and template (`python` unless
        named: a template's sessions are lean), from its warm pool when it can;
        or, given a snapshot id, a new session restored from that snapshot. `egress` asks
        for a policy of the server's (a name, or {policy, allow} to narrow one); nothing
        asked gets the server's `default` policy, if it has one. `metadata` labels it
        (string keys and values, `check_metadata`'s limits). `cell_timeout_s` is the time
        limit of its cells that ask for none (capped by --cell-timeout), kept with it.
        `env` is set in its kernel's environment and given to its commands. `volumes`
        are the owner's volumes it mounts, each {"name", "path"?, "read_only"?}; a
        session restored from a snapshot mounts the snapshot's.

        Raises:
            InvalidMetadata: metadata of the wrong shape or too large.
            InvalidEnvironment: env of the wrong shape or too large.
            TemplateNotFound, TemplateNotReady, TemplateFailed: the template can't serve.
            EgressRefused: an unknown policy, a rule wider than it, or no egress here.
            UnknownProfile: no profile of that name.
            TooManySessions: the server is at --max-sessions.
            SandboxStartError: no sandbox could be started.
            SnapshotNotFound: unknown snapshot, or another owner's.
            RestoreRefused: the snapshot's image can't be restored here.
            VolumeRefused: a bad volume name or path.
            VolumeNotFound: the owner has no volume of a name asked (or the snapshot's).
        """

    @abc.abstractmethod
    async def info(self, session_id: str, owner: str | None = None) -> SessionInfo:
        """Raises SessionNotFound for an unknown id or another owner's session, SessionLost
        for one that was live when a previous server died (or whose node failed)."""

    @abc.abstractmethod
    async def sessions(
        self,
        owner: str | None = None,
        *,
        every: bool = False,
        state: str | None = None,
        profile: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> list[SessionInfo]:
        """The owner's sessions (every owner's, with every: an admin's view), those in a
        state, of a profile, and carrying every pair of metadata given."""

    @abc.abstractmethod
    async def set_metadata(
        self, session_id: str, changes: Mapping[str, str | None], owner: str | None = None
    ) -> SessionInfo:
        """Merge changes into a session's metadata (a None value deletes its key).

        Raises:
            SessionNotFound: unknown id, or another owner's.
            InvalidMetadata: the result would be of the wrong shape or too large.
        """

    @abc.abstractmethod
    async def history(
        self,
        session_id: str,
        owner: str | None = None,
        *,
        after: int = 0,
        limit: int | None = None,
    ) -> builtins.list[CellEntry]:
        """A session's cells after the one numbered after, oldest first, at most limit.

        Raises:
            SessionNotFound: unknown id, or another owner's.
        """

    @abc.abstractmethod
    async def cell(self, session_id: str, number: int, owner: str | None = None) -> CellEntry:
        """One cell of a session's history.

        Raises:
            SessionNotFound: unknown id, or another owner's.
            CellNotFound: no cell of that number is kept.
        """

    # -- durability -----------------------------------------------------------------------

    @abc.abstractmethod
    async def snapshot(
        self, session_id: str, owner: str | None = None, name: str = ""
    ) -> SnapshotRecord:
        """Save the session as it is between cells; it goes on running, unaffected.

        Raises:
            SessionNotFound, SessionLost: as for `get`.
            StorageFull, CheckpointFailed: it could not be saved (it keeps running).
        """

    @abc.abstractmethod
    async def snapshots(self, owner: str | None = None) -> builtins.list[SnapshotRecord]:
        """The owner's snapshots, oldest first."""

    @abc.abstractmethod
    async def get_snapshot(self, snapshot_id: str, owner: str | None = None) -> SnapshotRecord:
        """Raises SnapshotNotFound for an unknown id or another owner's snapshot."""

    @abc.abstractmethod
    async def delete_snapshot(self, snapshot_id: str, owner: str | None = None) -> None:
        """Delete a snapshot and its image. Raises SnapshotNotFound."""

    @abc.abstractmethod
    async def fork(
        self, session_id: str, count: int = 1, owner: str | None = None
    ) -> list[SessionInfo]:
        """count new sessions, each a copy of the session as it is now (between cells);
        the original goes on running.

        Raises:
            SessionNotFound, SessionLost: as for `get`.
            TooManySessions: the copies would take the server past --max-sessions.
            CheckpointFailed, RestoreRefused: the copies could not be made.
        """

    @abc.abstractmethod
    async def pause(self, session_id: str, owner: str | None = None) -> SessionInfo:
        """Save the session to disk and stop its sandbox, after its running cell."""

    @abc.abstractmethod
    async def resume(self, session_id: str, owner: str | None = None) -> SessionInfo:
        """Bring a paused session back now (any request to it does so by itself)."""

    @abc.abstractmethod
    async def execute(
        self,
        session_id: str,
        code: str,
        *,
        owner: str | None = None,
        timeout_s: float | None = None,
        on_event: EventCallback | None = None,
        track_files: bool = False,
        silent: bool = False,
        stdin: bool = False,
        pager: bool = False,
        front_end: str = "",
        accepted: asyncio.Event | None = None,
    ) -> CellResult:
        """Run a cell in a session (queued behind the running one). Its history keeps it
        (unless silent), saying which front end sent it. `accepted` is set once the cell is
        queued, not refused as busy (a stream's answer waits for it, or for the refusal).

        timeout_s is capped by the server's --cell-timeout. With track_files, the result
        lists the files the cell created or changed in the working directory. A silent
        cell (the server's own setup) runs in a namespace of its own and is not counted.
        With stdin (and on_event), the cell's input() and getpass() send on_event an
        {"type": "input_request", "prompt", "password"} event, answered by `answer_input`;
        without, they raise StdinNotImplementedError in the cell. With pager (and on_event),
        `obj?` sends on_event a {"type": "page", "text"} event instead of printing.

        Raises:
            SessionNotFound: unknown id, another owner's, or closed before the cell ran.
            SessionBusy: too many cells already waiting in this session.
        """

    async def create_and_execute(
        self,
        code: str,
        *,
        owner: str | None = None,
        timeout_s: float | None = None,
        on_event: EventCallback | None = None,
        profile: str = "lean",
        template: str | None = None,
        front_end: str = "",
    ) -> tuple[str, CellResult]:
        """Create a session (of a profile and template) and run a first cell in it;
        (session id, result)."""
        info = await self.create(owner, profile, template=template)
        result = await self.execute(
            info.id, code, owner=owner, timeout_s=timeout_s, on_event=on_event, front_end=front_end
        )
        return info.id, result

    # -- the working directory: a paused session is brought back first -------------------

    @abc.abstractmethod
    async def list_files(self, session_id: str, owner: str | None = None) -> FileListing:
        """The regular files of the session's working directory.

        Raises:
            SessionNotFound: unknown id or another owner's session.
        """

    @abc.abstractmethod
    async def read_file(self, session_id: str, path: str, owner: str | None = None) -> bytes:
        """A file of the working directory. Raises PathRefused, PathNotFound, SessionNotFound."""

    async def read_stream(
        self, session_id: str, path: str, owner: str | None = None
    ) -> tuple[int, AsyncGenerator[bytes, None]]:
        """A file of the working directory in pieces of at most READ_PIECE_BYTES, and its
        size: memory stays flat however large it is. The pieces must be read to the end, or
        the iterator closed (`aclose`). By default, `read_file` in one piece.

        Raises:
            PathRefused, PathNotFound, SessionNotFound: before any piece.
        """
        data = await self.read_file(session_id, path, owner)

        async def one() -> AsyncGenerator[bytes, None]:
            yield data

        return len(data), one()

    @abc.abstractmethod
    async def write_files(
        self, session_id: str, files: Sequence[tuple[str, bytes]], owner: str | None = None
    ) -> None:
        """Create or replace files (path, content), in order. Raises PathRefused (then the
        files before the refused one are written), SessionNotFound."""

    @abc.abstractmethod
    async def write_stream(
        self,
        session_id: str,
        path: str,
        chunks: AsyncIterable[bytes],
        owner: str | None = None,
    ) -> int:
        """Create or replace a file at the root of the working directory from chunks of
        unknown total size; its size in bytes. Nothing is left of it when it fails.

        Raises:
            PathRefused: a bad name, over the size of the working directory, or disk full.
            SessionNotFound: unknown id or another owner's session.
        """

    async def install_packages(
        self, session_id: str, specs: Sequence[str], owner: str | None = None
    ) -> InstalledPackages:
        """Install packages into a session, queued as a cell; [{name, version}] installed.

        Raises:
            SessionNotFound: unknown id or another owner's session.
            PackageInstallError: refused or failed; the session is as it was.
        """
        raise PackageInstallError(f"{type(self).__name__} can't install packages")

    @abc.abstractmethod
    async def interrupt(self, session_id: str, owner: str | None = None) -> bool:
        """Interrupt the running cell; False when none was running. A paused session is
        brought back first."""

    @abc.abstractmethod
    async def restart(self, session_id: str, owner: str | None = None) -> SessionInfo:
        """A fresh interpreter for the session, same id: its running cell is stopped, its
        variables and imports are gone (its working directory stays). A paused session is
        brought back first. Raises SessionNotFound."""

    @abc.abstractmethod
    async def answer_input(self, session_id: str, value: str, owner: str | None = None) -> bool:
        """Give the value to the running cell's input(); False when no input() waits.
        Raises SessionNotFound."""

    @abc.abstractmethod
    async def close(
        self, session_id: str, owner: str | None = None, reason: str = "closed"
    ) -> None:
        """Close a session. Raises SessionNotFound."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Get ready to serve (prepare the backend, fill the pool)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Interrupt running cells, close every session and sandbox."""

    @property
    @abc.abstractmethod
    def healthy(self) -> bool:
        """Whether a new session can be served now."""

    @abc.abstractmethod
    async def wait_ready(self, profile: str = "lean", timeout_s: float = 120.0) -> None:
        """Wait until the pools of a profile hold their ready sandboxes (start-up, tests)."""

    async def node_metrics(self) -> dict[str, str]:
        """Prometheus text of each node that holds sessions for this manager, by node id,
        for /metrics to label `node` (a cluster's); empty on one machine."""
        return {}

    def cluster_view(self) -> dict[str, Any] | None:
        """GET /v1/cluster: the Ray cluster's address and its nodes; None on one machine."""
        return None

    async def drain(self, node_id: str, grace_s: float | None = None) -> dict[str, Any]:
        """Move a node's sessions to the other nodes, for at most grace_s (default
        --node-grace); node_id may be its address. Raises NodeNotFound."""
        raise NodeNotFound("this server is not a cluster (start it with --cluster)")

    async def undrain(self, node_id: str) -> dict[str, Any]:
        """Return a draining node to service. Raises NodeNotFound."""
        raise NodeNotFound("this server is not a cluster (start it with --cluster)")

    # -- templates: a cluster offers only the built-in `python` ------------------------------

    async def templates(self) -> builtins.list[TemplateInfo]:
        """Every template: the built-in `python`, then those built here, by name."""
        return [python_template()]

    async def template(self, name: str) -> TemplateInfo:
        """One template's record (state, progress, the builder's lines on failure).

        Raises:
            TemplateNotFound: no template of that name.
        """
        if name == BUILT_IN:
            return python_template()
        raise TemplateNotFound(name, f": {_TEMPLATES_HERE_ONLY}")

    async def build_template(
        self,
        name: str,
        source: TemplateSource,
        upload: AsyncIterable[bytes] | None = None,
    ) -> TemplateInfo:
        """Start building a template from source; its record at once, in state building.
        With upload, the source's file is those bytes (a tarball, or a docker-archive for
        kind "image"), up to --template-max-mib.

        Raises:
            TemplateRefused: a bad name, the built-in's, a source that is not there.
            TemplateExists: one of that name is ready or being built (delete it first).
            NotSupported: this server builds no templates (a cluster).
        """
        raise NotSupported(_TEMPLATES_HERE_ONLY)

    async def delete_template(self, name: str) -> None:
        """Delete a template (a build under way is stopped).

        Raises:
            TemplateNotFound: no template of that name.
            TemplateInUse: live or paused sessions use it.
            TemplateRefused: the built-in `python`.
            NotSupported: this server builds no templates (a cluster).
        """
        raise NotSupported(_TEMPLATES_HERE_ONLY)
