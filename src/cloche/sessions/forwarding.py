"""The verbs of a manager that wraps another and changes nothing about them: passed on.

`QuotaGate` (quotas.py) checks a few verbs and passes every other one on with this mixin,
beside the groups' own forwarding mixins (commands, files, ports, volumes).
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncGenerator, AsyncIterable, Sequence
from typing import Any

from cloche.sandbox.images import TemplateInfo
from cloche.sandbox.listing import FileListing
from cloche.sessions.manager import InstalledPackages, SessionManager
from cloche.sessions.session import SessionInfo
from cloche.sessions.store import SnapshotRecord


class ForwardedSessionVerbs(SessionManager):
    """The session manager's verbs a wrapper (whose `inner` is the manager it wraps) passes
    on as they are."""

    @property
    def _inner(self) -> SessionManager:
        inner: SessionManager = getattr(self, "inner")  # noqa: B009  # the wrapper's own
        return inner

    async def info(self, *args: Any, **kwargs: Any) -> SessionInfo:
        return await self._inner.info(*args, **kwargs)

    async def sessions(self, *args: Any, **kwargs: Any) -> builtins.list[SessionInfo]:
        return await self._inner.sessions(*args, **kwargs)

    async def set_metadata(self, *args: Any, **kwargs: Any) -> SessionInfo:
        return await self._inner.set_metadata(*args, **kwargs)

    async def history(self, *args: Any, **kwargs: Any) -> Any:
        return await self._inner.history(*args, **kwargs)

    async def cell(self, *args: Any, **kwargs: Any) -> Any:
        return await self._inner.cell(*args, **kwargs)

    async def snapshots(self, *args: Any, **kwargs: Any) -> builtins.list[SnapshotRecord]:
        return await self._inner.snapshots(*args, **kwargs)

    async def get_snapshot(self, *args: Any, **kwargs: Any) -> SnapshotRecord:
        return await self._inner.get_snapshot(*args, **kwargs)

    async def list_files(self, *args: Any, **kwargs: Any) -> FileListing:
        return await self._inner.list_files(*args, **kwargs)

    async def read_file(self, *args: Any, **kwargs: Any) -> bytes:
        return await self._inner.read_file(*args, **kwargs)

    async def read_stream(
        self, *args: Any, **kwargs: Any
    ) -> tuple[int, AsyncGenerator[bytes, None]]:
        return await self._inner.read_stream(*args, **kwargs)

    async def write_files(
        self, session_id: str, files: Sequence[tuple[str, bytes]], *args: Any, **kwargs: Any
    ) -> None:
        await self._inner.write_files(session_id, files, *args, **kwargs)

    async def write_stream(
        self, session_id: str, path: str, chunks: AsyncIterable[bytes], *args: Any, **kwargs: Any
    ) -> int:
        return await self._inner.write_stream(session_id, path, chunks, *args, **kwargs)

    async def install_packages(self, *args: Any, **kwargs: Any) -> InstalledPackages:
        return await self._inner.install_packages(*args, **kwargs)

    async def templates(self) -> list[TemplateInfo]:
        return await self._inner.templates()

    async def template(self, name: str) -> TemplateInfo:
        return await self._inner.template(name)

    async def build_template(self, *args: Any, **kwargs: Any) -> TemplateInfo:
        return await self._inner.build_template(*args, **kwargs)

    async def delete_template(self, name: str) -> None:
        await self._inner.delete_template(name)

    async def interrupt(self, *args: Any, **kwargs: Any) -> bool:
        return await self._inner.interrupt(*args, **kwargs)

    async def restart(self, *args: Any, **kwargs: Any) -> SessionInfo:
        return await self._inner.restart(*args, **kwargs)

    async def answer_input(self, *args: Any, **kwargs: Any) -> bool:
        return await self._inner.answer_input(*args, **kwargs)

    async def start(self) -> None:
        await self._inner.start()

    async def stop(self) -> None:
        await self._inner.stop()

    @property
    def healthy(self) -> bool:
        return self._inner.healthy

    async def wait_ready(self, *args: Any, **kwargs: Any) -> None:
        await self._inner.wait_ready(*args, **kwargs)

    async def node_metrics(self) -> dict[str, str]:
        return await self._inner.node_metrics()

    def cluster_view(self) -> dict[str, Any] | None:
        return self._inner.cluster_view()

    async def drain(self, node_id: str, grace_s: float | None = None) -> dict[str, Any]:
        return await self._inner.drain(node_id, grace_s)

    async def undrain(self, node_id: str) -> dict[str, Any]:
        return await self._inner.undrain(node_id)
