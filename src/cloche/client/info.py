"""What the server tells about a session, a snapshot and a file of a working directory."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    """What the server says about a session."""

    id: str
    profile: str
    state: str  # idle, busy, paused, closing, closed
    created_at: datetime.datetime
    expires_at: datetime.datetime  # when it will be closed if left idle
    execution_count: int
    limits: dict[str, float]  # cell_timeout_s, memory_mib, disk_mib, ...
    egress: dict[str, Any] | None = None  # its egress policy ({policy, allow?}), if any
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)  # its labels
    last_cell: dict[str, Any] | None = None  # {number, end_reason, ended_at}, if it ran any
    cpu_s: float | None = None  # CPU time its sandbox has used (in listings only)
    memory_bytes: int | None = None  # memory its sandbox holds now (in listings only)
    template: str = "python"  # the template its system is made of
    volumes: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # what it mounts

    @property
    def cell_timeout_s(self) -> float:
        return float(self.limits.get("cell_timeout_s", 30.0))

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> SessionInfo:
        return cls(
            id=str(body["id"]),
            profile=str(body.get("profile", "lean")),
            state=str(body.get("state", "")),
            created_at=datetime.datetime.fromisoformat(body["created_at"]),
            expires_at=datetime.datetime.fromisoformat(body["expires_at"]),
            execution_count=int(body.get("execution_count", 0)),
            limits=dict(body.get("limits") or {}),
            egress=body.get("egress"),
            metadata={str(k): str(v) for k, v in (body.get("metadata") or {}).items()},
            last_cell=body.get("last_cell"),
            cpu_s=body.get("cpu_s"),
            memory_bytes=body.get("memory_bytes"),
            template=str(body.get("template") or "python"),
            volumes=list(body.get("volumes") or []),
        )


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    """A saved session: restore it with `create_session(snapshot=...)`."""

    id: str
    session_id: str  # the session it was taken of
    name: str
    profile: str
    created_at: datetime.datetime
    size_bytes: int
    execution_count: int

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> SnapshotInfo:
        return cls(
            id=str(body["id"]),
            session_id=str(body["session_id"]),
            name=str(body.get("name", "")),
            profile=str(body.get("profile", "lean")),
            created_at=datetime.datetime.fromisoformat(body["created_at"]),
            size_bytes=int(body.get("size_bytes", 0)),
            execution_count=int(body.get("execution_count", 0)),
        )


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """A file in a session's working directory."""

    path: str
    size_bytes: int
    modified: float  # Unix time, s
