"""Request and response bodies of the HTTP API (they make its OpenAPI schema)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ErrorDetail(BaseModel):
    type: str = Field(description="What went wrong, as a short name (not_found, busy, ...)")
    message: str = Field(description="What went wrong and, where it helps, what to change")


class ErrorBody(BaseModel):
    """Every error of the API (except Terrarium's endpoint, which keeps its own shape)."""

    error: ErrorDetail


class FileIn(BaseModel):
    filename: str = Field(description="Path under the working directory; sub-directories are made")
    b64_data: str = Field(description="The file's content, base64")


class TerrariumRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    code: str | None = Field(default=None, description="Python to run in a fresh session")
    files: list[FileIn] = Field(default_factory=list, description="Files to put there first")


class TerrariumError(BaseModel):
    type: str = Field(description="The exception's name, or parsing, timeout, memory, killed")
    message: str


class TerrariumResponse(BaseModel):
    """Terrarium's answer: one JSON object, then a newline."""

    success: bool
    final_expression: Any = Field(
        default=None, description="The last expression's value: JSON when JSON-native, else repr"
    )
    std_out: str = ""
    std_err: str = ""
    code_runtime: int = Field(default=0, description="Wall time of the code, ms")
    output_files: list[FileIn] = Field(default_factory=list)
    error: TerrariumError | None = None


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    profile: Literal["lean", "data"] = Field(
        default="lean", description="lean: nothing preloaded; data: numpy, pandas, ... imported"
    )
    timeout: float | None = Field(
        default=None,
        gt=0,
        description="Default time limit of this session's cells, s "
        "(at most the server's --cell-timeout)",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables to set")
    files: list[FileIn] = Field(default_factory=list, description="Files to put in /work")


class SessionLimits(BaseModel):
    cell_timeout_s: float
    memory_mib: int
    disk_mib: int
    output_bytes: int
    nproc: int
    idle_timeout_s: float
    lifetime_s: float


class SessionOut(BaseModel):
    id: str
    profile: str
    state: str
    created_at: str = Field(description="ISO 8601, UTC")
    expires_at: str = Field(description="When it will be closed if left idle (ISO 8601, UTC)")
    execution_count: int
    limits: SessionLimits


class SessionList(BaseModel):
    sessions: list[SessionOut]


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    code: str = Field(description="Python to run in the session")
    timeout: float | None = Field(default=None, gt=0, description="Time limit of this cell, s")


class CellErrorOut(BaseModel):
    ename: str
    evalue: str
    traceback: list[str]


class ExecuteResponse(BaseModel):
    """Everything the cell produced (see the execution spec)."""

    status: Literal["ok", "error", "timeout", "interrupted", "killed"]
    stdout: str
    stderr: str
    result: dict[str, Any] | None = Field(
        description="The last expression's MIME bundle, e.g. {'text/plain': '2'}"
    )
    result_json: Any = Field(default=None, description="The value itself, when JSON-native")
    displays: list[dict[str, Any]] = Field(description="MIME bundles shown during the cell")
    error: CellErrorOut | None
    files: list[str] = Field(description="Files created or changed in the working directory")
    duration_ms: float
    execution_count: int
    message: str | None = Field(default=None, description="A limit hit, or why the session ended")
    session_alive: bool


class InterruptResponse(BaseModel):
    interrupted: bool = Field(description="Whether a cell was running")


class FileOut(BaseModel):
    path: str
    size_bytes: int
    modified: float = Field(description="Unix time, s")


class FileList(BaseModel):
    files: list[FileOut]
    truncated: bool = Field(description="True when the listing stopped at its cap")
