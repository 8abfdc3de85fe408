"""The client of cloche's HTTP API, written once, async (the sync facade in `sync.py` wraps it).

Example:
    async with cloche.AsyncClient("http://127.0.0.1:8080") as client:
        async with await client.create_session() as session:
            await session.run("x = 41")
            execution = await session.run("x + 1", on_stdout=print)
            print(execution.text)  # 42
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Literal
from urllib.parse import quote

import httpx

from cloche.client import templates as _templates
from cloche.client._errors import error_for, translated
from cloche.client._files import FileData, encode
from cloche.client.execution import Execution
from cloche.client.info import SessionInfo, SnapshotInfo
from cloche.client.ports import AsyncPorts
from cloche.client.verbs import DisplayCallback, OutputCallback, SessionVerbs
from cloche.client.volumes import AsyncVolumeVerbs, VolumeAsk, mounts
from cloche.errors import ClocheError, SessionNotFound

DEFAULT_URL = "http://127.0.0.1:8080"


def default_url() -> str:
    """CLOCHE_URL, else http://127.0.0.1:8080."""
    return os.environ.get("CLOCHE_URL") or DEFAULT_URL


def default_token() -> str | None:
    """CLOCHE_TOKEN (its first entry, when it lists several as `cloche serve` accepts)."""
    tokens = [t.strip() for t in os.environ.get("CLOCHE_TOKEN", "").split(",") if t.strip()]
    return tokens[0] if tokens else None


class AsyncClient(AsyncVolumeVerbs):
    """A connection to a cloche server's HTTP API (its volume verbs: `AsyncVolumeVerbs`).

    Args:
        url: the server's HTTP address; default CLOCHE_URL, else http://127.0.0.1:8080.
        token: the bearer token, when the server has --token; default CLOCHE_TOKEN.
        timeout_s: how long to wait for an answer to anything but a cell (a cell gets
            its own time limit plus a margin).
        transport: an httpx transport to use instead of the network (e.g. ASGITransport).

    Raises (from every method):
        ServerUnreachable: nothing answers at `url`.
        Unauthorized: the server needs a token and `token` is missing or wrong.
        RequestTimeout: no answer within `timeout_s`.
        UnexpectedResponse: `url` is not a cloche server's HTTP port.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = (url or default_url()).rstrip("/")
        self.token = token if token is not None else default_token()
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=timeout_s, transport=transport
        )

    async def create_session(
        self,
        profile: str = "lean",
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the server's limit for cells)
        env: Mapping[str, str] | None = None,
        files: Mapping[str, FileData] | None = None,
        snapshot: str | SnapshotInfo | None = None,
        egress: str | Mapping[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
        template: str | None = None,
        volumes: Sequence[VolumeAsk] = (),
    ) -> AsyncSession:
        """A new session.

        Args:
            profile: `lean` (nothing preloaded), `data` (numpy, pandas, matplotlib, scipy
                and sympy preloaded: importing them costs nothing), or one of the server's
                --profiles file.
            timeout: default time limit of its cells, s (at most the server's --cell-timeout).
            env: environment variables to set in it.
            files: files to put in its working directory first, by path.
            snapshot: start from this snapshot (its variables, imports and files) instead;
                the session then has the snapshot's profile.
            egress: network access through the server's egress proxy: the name of one of
                its policies (--egress-policy), or {"policy": name, "allow": [rules]} to
                narrow one. Nothing: the server's `default` policy, if it has one.
            metadata: labels of your choosing (string keys and values, at most 32 pairs and
                4 KiB), to find it by with `list_sessions(metadata=...)`; from a snapshot,
                its session's when left out.
            template: the system it runs (`templates()` lists them): `python` (the
                default: the server's interpreter and runtime), or one built from an
                image; a template's sessions are of profile lean.
            volumes: volumes of this token it mounts, each a name (at /mnt/NAME) or
                {"name", "path", "read_only"}; from a snapshot, the snapshot's.

        Raises:
            InvalidMetadata: metadata of the wrong shape or over the limits.
            EgressRefused: an unknown policy, or rules wider than it (403).
            TooManySessions: the server holds --max-sessions sessions already.
            SandboxError: the server could not start a sandbox.
            InvalidRequest: an unknown profile or a bad value.
            TemplateNotFound, TemplateNotReady, TemplateFailed: the template can't serve.
            SnapshotNotFound: unknown snapshot, or another token's.
            RestoreRefused: the snapshot can't be restored on this server.
        """
        body: dict[str, Any] = {}
        if snapshot is not None:
            body["snapshot"] = snapshot if isinstance(snapshot, str) else snapshot.id
        else:
            body["profile"] = profile
        if template is not None:
            body["template"] = template
        if timeout is not None:
            body["timeout"] = timeout
        if egress is not None:
            body["egress"] = egress if isinstance(egress, str) else dict(egress)
        if metadata is not None:
            body["metadata"] = dict(metadata)
        if env:
            body["env"] = dict(env)
        if volumes:
            body["volumes"] = mounts(volumes)
        if files:
            body["files"] = [
                {"filename": name, "b64_data": base64.b64encode(encode(data)).decode()}
                for name, data in files.items()
            ]
        response = await self._request("POST", "/v1/sessions", json=body)
        return AsyncSession(self, SessionInfo.from_json(response.json()))

    async def session(self, session_id: str) -> AsyncSession:
        """An existing session, by id.

        Raises:
            SessionNotFound: unknown, closed, expired, or another token's.
        """
        return AsyncSession(self, await self.get_session(session_id))

    async def get_session(self, session_id: str) -> SessionInfo:
        """What the server says about a session now. Raises SessionNotFound."""
        response = await self._request(
            "GET", f"/v1/sessions/{quote(session_id, safe='')}", session_id=session_id
        )
        return SessionInfo.from_json(response.json())

    async def list_sessions(
        self,
        *,
        state: str | None = None,
        profile: str | None = None,
        metadata: Mapping[str, str] | None = None,
        every_tenant: bool = False,
    ) -> list[SessionInfo]:
        """The sessions of this client's token (every session, on a server without tokens).

        Args:
            state: only those in this state: idle, busy or paused.
            profile: only those of this profile.
            metadata: only those carrying every one of these pairs.
            every_tenant: an admin's token: every tenant's sessions (a user's: its own).
        """
        params = {f"metadata.{key}": value for key, value in (metadata or {}).items()}
        if every_tenant:
            params["all"] = "true"
        if state is not None:
            params["state"] = state
        if profile is not None:
            params["profile"] = profile
        response = await self._request("GET", "/v1/sessions", params=params)
        return [SessionInfo.from_json(item) for item in response.json()["sessions"]]

    async def close_session(self, session_id: str) -> None:
        """Close a session. Raises SessionNotFound."""
        await self._request(
            "DELETE", f"/v1/sessions/{quote(session_id, safe='')}", session_id=session_id
        )

    # -- a cluster's nodes (an admin's token) ---------------------------------------------

    async def cluster(self) -> dict[str, Any]:
        """A cluster-mode server's nodes (`GET /v1/cluster`). Raises Forbidden for a user's
        token, NodeNotFound on a single server."""
        response = await self._request("GET", "/v1/cluster")
        view: dict[str, Any] = response.json()
        return view

    async def drain_node(self, node: str, grace_s: float | None = None) -> dict[str, Any]:
        """Move a node's sessions and snapshots to the others (node: its id, or its
        address), for grace_s at most (default the server's --node-grace); the report
        {node, moved, failed, why, snapshots, snapshots_left}."""
        params = {"grace_s": grace_s} if grace_s is not None else {}
        wait = (grace_s or 25.0) + max(self.timeout_s, 60.0)  # the drain answers when done
        response = await self._request(
            "POST",
            f"/v1/cluster/nodes/{quote(node, safe='')}/drain",
            params=params,
            timeout=wait,
        )
        report: dict[str, Any] = response.json()
        return report

    async def resume_node(self, node: str) -> dict[str, Any]:
        """Return a draining node to service."""
        response = await self._request("POST", f"/v1/cluster/nodes/{quote(node, safe='')}/resume")
        answer: dict[str, Any] = response.json()
        return answer

    async def list_snapshots(self) -> list[SnapshotInfo]:
        """The snapshots of this client's token, oldest first."""
        response = await self._request("GET", "/v1/snapshots")
        return [SnapshotInfo.from_json(item) for item in response.json()["snapshots"]]

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        """One snapshot. Raises SnapshotNotFound."""
        response = await self._request(
            "GET", f"/v1/snapshots/{quote(snapshot_id, safe='')}", snapshot_id=snapshot_id
        )
        return SnapshotInfo.from_json(response.json())

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot and its image. Raises SnapshotNotFound."""
        await self._request(
            "DELETE", f"/v1/snapshots/{quote(snapshot_id, safe='')}", snapshot_id=snapshot_id
        )

    # -- templates (`cloche.client.templates`; building and deleting take an admin's token) --

    async def templates(self) -> list[dict[str, Any]]:
        """Every template (the built-in `python` first), each its JSON record."""
        return await _templates.list_all(self)

    async def template(self, name: str) -> dict[str, Any]:
        """One template's record: state, progress, the builder's lines. Raises
        TemplateNotFound."""
        return await _templates.get(self, name)

    async def build_template(
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
        """Build a template: from one source on the server (from_tar, from_image as a REF,
        or dockerfile with its context), or from a local file sent as the body (upload: a
        root filesystem tarball with kind "tar", a `docker save` archive with kind "image").
        Answers at once in state building, unless wait (then when ready).

        Raises:
            Forbidden: the token is not an admin's.
            TemplateExists, TemplateRefused: see the server's message.
            TemplateFailed: with wait, the build failed (the builder's last line).
        """
        built = await _templates.build(
            self,
            name,
            from_tar=from_tar,
            from_image=from_image,
            dockerfile=dockerfile,
            context=context,
            upload=None if upload is None else os.fspath(upload),
            kind=kind,
        )
        return await _templates.wait(self, name, wait_timeout_s) if wait else built

    async def delete_template(self, name: str) -> None:
        """Delete a template. Raises TemplateNotFound, TemplateInUse, Forbidden."""
        await _templates.delete(self, name)

    async def run(
        self,
        code: str,
        *,
        files: Mapping[str, FileData] | None = None,
        profile: str = "lean",
        timeout: float | None = None,  # noqa: ASYNC109 (the server's limit for cells)
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_display: DisplayCallback | None = None,
    ) -> Execution:
        """Run code once in a fresh session, closed afterwards.

        The files the code created or changed come back in `Execution.output_files`.
        Arguments are those of `create_session` and `AsyncSession.run`.
        """
        session = await self.create_session(profile, files=files)
        try:
            execution = await session.run(
                code,
                timeout=timeout,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                on_display=on_display,
            )
            outputs = {}
            if execution.session_alive:
                for name in execution.files:
                    outputs[name] = await session.download(name)
            return dataclasses.replace(execution, output_files=outputs)
        finally:
            await session.close()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- the wire ---------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        session_id: str | None = None,
        file_path: str | None = None,
        snapshot_id: str | None = None,
        cell_number: int | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One request; a refusal or a failure raised as the tree's exception."""
        async with translated(self.url, self.timeout_s):
            response = await self._http.request(method, path, **kwargs)
        if response.is_success:
            return response
        raise self._error(
            response,
            session_id=session_id,
            file_path=file_path,
            snapshot_id=snapshot_id,
            cell_number=cell_number,
        )

    def _error(
        self,
        response: httpx.Response,
        *,
        session_id: str | None = None,
        file_path: str | None = None,
        snapshot_id: str | None = None,
        cell_number: int | None = None,
    ) -> ClocheError:
        return error_for(
            response,
            url=self.url,
            token=self.token,
            session_id=session_id,
            file_path=file_path,
            snapshot_id=snapshot_id,
            cell_number=cell_number,
        )


class AsyncSession(SessionVerbs):
    """A live Python interpreter in its own sandbox on the server.

    Variables, imports and files persist from one `run` to the next. Closing it (or
    leaving `async with`) ends it; it also ends by itself after the server's
    --idle-timeout. Its verbs (`run`, `upload`, `fork`, ...) are `SessionVerbs`'.
    """

    client: AsyncClient

    def __init__(self, client: AsyncClient, info: SessionInfo) -> None:
        super().__init__(client, info)
        self.ports = AsyncPorts(client, info.id)  # its servers: `list()`, `url(port)`

    async def refresh(self) -> SessionInfo:
        """What the server says about this session now."""
        self.info = await self.client.get_session(self.id)
        return self.info

    async def close(self) -> None:
        """End the session and its sandbox. Idempotent: an already ended one is fine."""
        if self.closed:
            return
        with contextlib.suppress(SessionNotFound):
            await self.client.close_session(self.id)
        self.closed = True

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncSession {self.id} profile={self.info.profile} template={self.info.template}>"
