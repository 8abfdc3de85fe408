"""How a live session of one machine is made: a kernel taken from the warm pool of its
profile and template (or a snapshot restored, by the durability layers), its environment
set, its kernel equipped with what its cells reach through the channel (llm_query,
packages), and its record written.

The layer of `LocalSessionManager` (`sessions.local`) over `sessions.mounts`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from cloche.errors import SandboxError, VolumeRefused
from cloche.packages.bridge import KernelPip
from cloche.sessions.doors import EgressAsk, egress_record, owner_tag, placeholders_of
from cloche.sessions.history import History
from cloche.sessions.kernel import KernelClient
from cloche.sessions.manager import check_env, check_metadata, new_session_id
from cloche.sessions.mounts import VolumeSessions
from cloche.sessions.profiles import PYTHON
from cloche.sessions.result import CellStatus
from cloche.sessions.session import Session, SessionInfo, owner_key
from cloche.sessions.store import RecordState, SessionRecord
from cloche.volumes.paths import VolumeMount

log = logging.getLogger("cloche.session")
ENV_TIMEOUT_S = 30.0  # for a new session's kernel to take its environment


class NewSessions(VolumeSessions):
    """Live sessions, and how new ones are made."""

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
        labels = check_metadata(metadata or {})
        variables = check_env(env or {})
        mounts = self._volume_mounts(volumes, template or PYTHON)
        if mounts and snapshot is not None:
            raise VolumeRefused(
                "a session restored from a snapshot mounts the snapshot's volumes: leave out "
                "volumes"
            )
        if egress is None and self.catalog is not None:  # the profile's own, if it has one
            status = self.catalog.statuses.get(profile)
            if status is not None and status.spec is not None:
                egress = status.spec.egress
        policy = self.doors.policy_for(egress)
        placeholders: dict[str, str] = {}
        if snapshot is not None:
            taken = self._snapshot(snapshot, owner).egress
            placeholders = placeholders_of(taken)  # in the image's memory
            if egress is None:  # the snapshot's own, as it was taken
                policy = self.doors.policy_again(taken, snapshot)
            session = await self._from_snapshot(snapshot, owner, labels if metadata else None)
        else:
            with self._claim_volumes(owner_key(owner), mounts):
                session = await self._create(owner, profile, labels, template or PYTHON, mounts)
        changed = False
        if cell_timeout_s is not None and cell_timeout_s > 0:
            session.cell_timeout_s = min(cell_timeout_s, self.limits.cell_timeout_s)
            changed = True
        if variables:
            try:
                assert session.kernel is not None
                await self._set_env(session.kernel, variables)
            except BaseException:
                self._remove(session, "lost")
                await self._close(session, "lost")
                raise
            session.env = {**session.env, **variables}
            changed = True
        if changed:
            await asyncio.to_thread(self.store.save, self._record(session, RecordState.LIVE))
        if policy is not None:
            session.placeholders = placeholders
            try:
                await self.doors.open(session, policy)
            except BaseException:
                self._remove(session, "lost")
                await self._close(session, "lost")
                raise
        info = session.info()
        data: dict[str, Any] = {
            "profile": info.profile,
            "template": session.template,
            "metadata": info.metadata,
        }
        if info.volumes:
            data["volumes"] = info.volumes
        self._tell("session.created", session, {**data, "snapshot": snapshot} if snapshot else data)
        return info

    async def _create(
        self,
        owner: str | None,
        profile: str = "lean",
        metadata: dict[str, str] | None = None,
        template: str = PYTHON,
        mounts: list[VolumeMount] | None = None,
    ) -> Session:
        pool = await self._pool(profile, template)
        await self._room_for(1)
        key = owner_key(owner)
        self._creating += 1
        try:
            if mounts:  # a pooled sandbox has no volumes: one is started with them
                kernel = await pool.start_for(self._volume_setup(key, mounts))
            else:
                kernel = await pool.take()
        finally:
            self._creating -= 1
        return self._adopt(
            kernel, key, profile, metadata=metadata, template=template, volumes=mounts
        )

    def _adopt(
        self,
        kernel: KernelClient,
        key: str | None,
        profile: str,
        execution_count: int = 0,
        *,
        metadata: dict[str, str] | None = None,
        history: History | None = None,
        cell_timeout_s: float | None = None,
        template: str = PYTHON,
        env: Mapping[str, str] | None = None,
        volumes: Sequence[VolumeMount] | None = None,
    ) -> Session:
        """A new session (new id) on a started kernel, with its record on disk (and the
        metadata, history, template, environment and volumes of the session it copies, if
        any)."""
        session = Session(
            new_session_id(),
            kernel,
            key,
            self.config.max_queued_cells,
            profile=profile,
            freeze_idle_s=self.config.limits.freeze_idle_s,
            execution_count=execution_count,
            gate=self.gate,
        )
        session.waker = self._wake
        session.metadata = dict(metadata or {})
        session.cell_timeout_s = cell_timeout_s
        session.template = template
        session.env = dict(env or {})
        session.volumes = list(volumes or ())
        session.history = history.copy() if history is not None else self._new_history()
        self._equip(session, kernel)
        self._sessions[session.id] = session
        self.store.save(self._record(session, RecordState.LIVE))
        self.created += 1
        self.observer.session_created(profile)
        log.info(
            "session start id=%s sandbox=%s profile=%s owner=%s",
            session.id,
            kernel.id,
            profile,
            owner_tag(key),
        )
        return session

    def _equip(self, session: Session, kernel: KernelClient) -> None:
        """Give a session's kernel what its cells reach through the channel: the LLM broker
        and package installs."""
        if self.llm is not None:
            kernel.llm = self.llm.for_kernel(session.id, kernel)
        packages = self.installer.for_session(kernel.sandbox, self._runtime_of(session.profile))
        kernel.pip = KernelPip(packages, kernel)

    def _new_history(self) -> History:
        return History(self.config.history_cells)

    async def _set_env(self, kernel: KernelClient, env: Mapping[str, str]) -> None:
        """Put variables into a kernel's environment (its commands get them from the
        session's record).

        Raises:
            SandboxError: the kernel could not set them.
        """
        code = f"import os\nos.environ.update({json.dumps(dict(env))})"
        result = await kernel.execute(code, timeout_s=ENV_TIMEOUT_S, silent=True)
        if result.status is not CellStatus.OK:
            why = result.error["evalue"] if result.error else result.message
            raise SandboxError(f"could not set the session's environment: {why}")

    def _record(
        self, session: Session, state: RecordState, origin: str = "", paused_for: str = ""
    ) -> SessionRecord:
        info = session.info()
        return SessionRecord(
            id=session.id,
            owner_key=session.owner_key,
            profile=session.profile,
            created_at=info.created_at,
            last_active=info.last_active,
            execution_count=session.execution_count,
            state=state,
            egress=egress_record(session),
            origin=origin,
            metadata=dict(session.metadata),
            cell_timeout_s=session.cell_timeout_s,
            paused_for=paused_for,
            template=session.template,
            env=dict(session.env),
            volumes=[m.to_json() for m in session.volumes],
        )
