"""The blocking client: a thin facade that runs `AsyncClient` on a private event loop.

Every method submits the async one's coroutine to a loop on a daemon thread and waits
for it, so the behaviour (and its errors) is written once, in `aio.py`. Callbacks given
to `run` are called on that thread, in order.

Example:
    with cloche.Client() as client, client.create_session() as session:
        session.run("x = 41")
        print(session.run("x + 1").text)  # 42
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

from cloche.client._files import FileData
from cloche.client._loop import LoopThread
from cloche.client.aio import AsyncClient, AsyncSession
from cloche.client.execution import Cell, Execution
from cloche.client.info import FileInfo, SessionInfo, SnapshotInfo
from cloche.client.ports import Ports
from cloche.client.sync_processes import Commands, Terminal
from cloche.client.verbs import RLM_TIMEOUT_S, DisplayCallback, InputCallback, OutputCallback
from cloche.client.volumes import VolumeAsk, VolumeVerbs
from cloche.errors import ClocheError

# After Ctrl-C, how long to wait for the interrupted cell to end before dropping its stream
# (which makes the server stop it too); the server kills a cell that ignores an interrupt
# for its --interrupt-grace.
INTERRUPT_WAIT_S = 15.0


class Client(VolumeVerbs):
    """A blocking connection to a cloche server's HTTP API (its volume verbs: `VolumeVerbs`).

    Takes the arguments of `AsyncClient` (url, token, timeout_s) and raises the same
    exceptions; see there.
    """

    def __init__(
        self, url: str | None = None, token: str | None = None, *, timeout_s: float = 60.0
    ) -> None:
        self._loop = LoopThread()
        self._async: AsyncClient = AsyncClient(url, token, timeout_s=timeout_s)

    @property
    def url(self) -> str:
        return self._async.url

    @property
    def token(self) -> str | None:
        return self._async.token

    def create_session(
        self,
        profile: str = "lean",
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        files: Mapping[str, FileData] | None = None,
        snapshot: str | SnapshotInfo | None = None,
        egress: str | Mapping[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
        template: str | None = None,
        volumes: Sequence[VolumeAsk] = (),
    ) -> Session:
        """A new session, or one restored from a snapshot; see `AsyncClient.create_session`."""
        created = self._loop.call(
            self._async.create_session(
                profile,
                timeout=timeout,
                env=env,
                files=files,
                snapshot=snapshot,
                egress=egress,
                metadata=metadata,
                template=template,
                volumes=volumes,
            )
        )
        return Session(self._loop, created)

    def cluster(self) -> dict[str, Any]:
        """See `AsyncClient.cluster`."""
        return self._loop.call(self._async.cluster())

    def drain_node(self, node: str, grace_s: float | None = None) -> dict[str, Any]:
        """See `AsyncClient.drain_node`."""
        return self._loop.call(self._async.drain_node(node, grace_s))

    def resume_node(self, node: str) -> dict[str, Any]:
        """See `AsyncClient.resume_node`."""
        return self._loop.call(self._async.resume_node(node))

    def list_snapshots(self) -> list[SnapshotInfo]:
        return self._loop.call(self._async.list_snapshots())

    def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return self._loop.call(self._async.get_snapshot(snapshot_id))

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._loop.call(self._async.delete_snapshot(snapshot_id))

    def templates(self) -> list[dict[str, Any]]:
        """See `AsyncClient.templates`."""
        return self._loop.call(self._async.templates())

    def template(self, name: str) -> dict[str, Any]:
        """See `AsyncClient.template`."""
        return self._loop.call(self._async.template(name))

    def build_template(
        self,
        name: str,
        *,
        from_tar: str | None = None,
        from_image: str | None = None,
        dockerfile: str | None = None,
        context: str | None = None,
        upload: str | os.PathLike[str] | None = None,
        kind: Literal["tar", "image"] = "tar",
        wait: bool = False,
        wait_timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """See `AsyncClient.build_template`."""
        building = self._async.build_template(
            name,
            from_tar=from_tar,
            from_image=from_image,
            dockerfile=dockerfile,
            context=context,
            upload=upload,
            kind=kind,
            wait=wait,
            wait_timeout_s=wait_timeout_s,
        )
        return self._loop.call(building)

    def delete_template(self, name: str) -> None:
        """See `AsyncClient.delete_template`."""
        self._loop.call(self._async.delete_template(name))

    def session(self, session_id: str) -> Session:
        """An existing session, by id. Raises SessionNotFound."""
        return Session(self._loop, self._loop.call(self._async.session(session_id)))

    def get_session(self, session_id: str) -> SessionInfo:
        return self._loop.call(self._async.get_session(session_id))

    def list_sessions(
        self,
        *,
        state: str | None = None,
        profile: str | None = None,
        metadata: Mapping[str, str] | None = None,
        every_tenant: bool = False,
    ) -> list[SessionInfo]:
        """The token's sessions, filtered; see `AsyncClient.list_sessions`."""
        return self._loop.call(
            self._async.list_sessions(
                state=state, profile=profile, metadata=metadata, every_tenant=every_tenant
            )
        )

    def close_session(self, session_id: str) -> None:
        self._loop.call(self._async.close_session(session_id))

    def run(
        self,
        code: str,
        *,
        files: Mapping[str, FileData] | None = None,
        profile: str = "lean",
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: DisplayCallback | None = None,
    ) -> Execution:
        """Run code once in a fresh session, closed afterwards; see `AsyncClient.run`."""
        return self._loop.call(
            self._async.run(
                code,
                files=files,
                profile=profile,
                timeout=timeout,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                on_display=on_display,
            )
        )

    def close(self) -> None:
        if not self._loop.loop.is_closed():
            self._loop.call(self._async.aclose())
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Session:
    """A live Python interpreter in its own sandbox; see `AsyncSession`."""

    def __init__(self, loop: LoopThread, session: AsyncSession) -> None:
        self._loop = loop
        self._async = session
        self.ports = Ports(loop, session.ports)  # its servers: `list()`, `url(port)`

    @property
    def id(self) -> str:
        return self._async.id

    @property
    def info(self) -> SessionInfo:
        return self._async.info

    @property
    def metadata(self) -> dict[str, str]:
        return self._async.metadata

    @functools.cached_property
    def commands(self) -> Commands:
        """Its commands: run, start, list; see `AsyncCommands`."""
        return Commands(self._loop, self._async.commands)

    def pty(self, cols: int = 80, rows: int = 24, cmd: str | None = None) -> Terminal:
        """Open a terminal (a login shell, or cmd); see `AsyncSession.pty`."""
        return Terminal(self._loop, self._loop.call(self._async.pty(cols, rows, cmd)))

    def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: DisplayCallback | None = None,
        on_input: InputCallback | None = None,
    ) -> Execution:
        """Run a cell; see `AsyncSession.run`.

        Ctrl-C (KeyboardInterrupt) while it runs interrupts the cell through the API, as
        in Jupyter: the session and its state survive, and KeyboardInterrupt is raised
        once the cell has stopped.
        """
        future = self._loop.submit(
            self._async.run(
                code,
                timeout=timeout,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                on_display=on_display,
                on_input=on_input,
            )
        )
        try:
            return future.result()
        except KeyboardInterrupt:
            self._stop(future)
            raise

    def _stop(self, running: concurrent.futures.Future[Execution]) -> None:
        """Interrupt the cell through the API and let it end; else drop its stream."""
        try:
            if self._loop.call(self._async.interrupt()):
                running.result(INTERRUPT_WAIT_S)
        except (KeyboardInterrupt, concurrent.futures.TimeoutError, ClocheError):
            pass
        finally:
            running.cancel()  # a cell still queued is dropped by the server with its stream

    def upload(self, path: str, data: FileData) -> None:
        """Write a file in the working directory; see `AsyncSession.upload`."""
        self._loop.call(self._async.upload(path, data))

    def download(self, path: str) -> bytes:
        """A file of the working directory; see `AsyncSession.download`."""
        return self._loop.call(self._async.download(path))

    def list_files(self) -> list[FileInfo]:
        return self._loop.call(self._async.list_files())

    def set_context(self, context: Any, *, kind: Literal["text", "json"] | None = None) -> int:
        """Put a context in the session as `context`; see `AsyncSession.set_context`."""
        return self._loop.call(self._async.set_context(context, kind=kind))

    def rlm(
        self,
        query: str,
        *,
        context: Any = None,
        model: str | None = None,
        timeout_s: float = RLM_TIMEOUT_S,
    ) -> str:
        """Answer query with a Recursive Language Model; see `AsyncSession.rlm`."""
        return self._loop.call(
            self._async.rlm(query, context=context, model=model, timeout_s=timeout_s)
        )

    def install(self, *packages: str) -> list[dict[str, str]]:
        """Install packages into the session; see `AsyncSession.install`."""
        return self._loop.call(self._async.install(*packages))

    def interrupt(self) -> bool:
        """Interrupt the running cell; False when none was running."""
        return self._loop.call(self._async.interrupt())

    def snapshot(self, name: str = "") -> SnapshotInfo:
        """Save the session as it is now; see `AsyncSession.snapshot`."""
        return self._loop.call(self._async.snapshot(name))

    def fork(self, count: int = 1) -> list[Session]:
        """Independent copies of the session as it is now; see `AsyncSession.fork`."""
        return [Session(self._loop, copy) for copy in self._loop.call(self._async.fork(count))]

    def pause(self) -> SessionInfo:
        """Save the session to disk and free its memory; see `AsyncSession.pause`."""
        return self._loop.call(self._async.pause())

    def resume(self) -> SessionInfo:
        return self._loop.call(self._async.resume())

    def history(self, after: int = 0, limit: int | None = None) -> list[Cell]:
        """The cells the session has run, oldest first; see `AsyncSession.history`."""
        return self._loop.call(self._async.history(after, limit))

    def cell(self, number: int) -> Cell:
        """One cell of the history; see `AsyncSession.cell`. Raises CellNotFound."""
        return self._loop.call(self._async.cell(number))

    def update_metadata(self, changes: Mapping[str, str | None]) -> SessionInfo:
        """Merge labels into its metadata (None deletes); see `AsyncSession.update_metadata`."""
        return self._loop.call(self._async.update_metadata(changes))

    def refresh(self) -> SessionInfo:
        return self._loop.call(self._async.refresh())

    def close(self) -> None:
        """End the session. Idempotent."""
        self._loop.call(self._async.close())

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Session {self.id} profile={self.info.profile} template={self.info.template}>"


def run(
    code: str,
    *,
    files: Mapping[str, FileData] | None = None,
    profile: str = "lean",
    timeout: float | None = None,
    url: str | None = None,
    token: str | None = None,
    on_stdout: OutputCallback | None = None,
    on_stderr: OutputCallback | None = None,
    on_display: DisplayCallback | None = None,
) -> Execution:
    """Run code once in a fresh session on the server at `url` (default CLOCHE_URL).

    Args:
        code: Python source.
        files: files to put in the working directory first, by path.
        profile: `lean` or `data`.
        timeout: time limit of the cell, s.
        url: the server's HTTP address.
        token: its bearer token (default CLOCHE_TOKEN).
        on_stdout, on_stderr, on_display: streaming callbacks, as for `Session.run`.

    Returns:
        The Execution; `output_files` holds the files the code created or changed.
    """
    with Client(url, token) as client:
        return client.run(
            code,
            files=files,
            profile=profile,
            timeout=timeout,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_display=on_display,
        )
