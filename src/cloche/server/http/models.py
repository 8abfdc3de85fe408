"""Request and response bodies of the HTTP API (they make its OpenAPI schema)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


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


class EgressAsk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy: str = Field(default="default", max_length=200, description="A policy's name")
    allow: list[str] | None = Field(
        default=None,
        max_length=1000,
        description="Rules such as 'api.github.com:443', each inside the policy's",
    )


class VolumeMountIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=64, description="One of your volumes (GET /v1/volumes)")
    path: str | None = Field(
        default=None,
        max_length=1024,
        description="Where it appears inside, absolute (default /mnt/{name}); not in /proc, "
        "/dev or /sys",
    )
    read_only: bool = Field(default=False, strict=True, description="Writes inside fail with EROFS")


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    profile: str = Field(
        default="lean",
        max_length=32,
        pattern=r"^[a-z0-9][a-z0-9_-]*$",
        description="lean: nothing preloaded; data: numpy, pandas, ... imported; or a profile "
        "of the server's --profiles file (GET /v1/profiles)",
    )
    template: str | None = Field(
        default=None,
        max_length=32,
        pattern=r"^[a-z0-9][a-z0-9_-]*$",
        description="The system it runs: python (the default: the server's interpreter and "
        "runtime) or a template built from an image (GET /v1/templates); a template's "
        "sessions are of profile lean",
    )
    timeout: float | None = Field(
        default=None,
        gt=0,
        description="Default time limit of this session's cells, s "
        "(at most the server's --cell-timeout)",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables of its kernel and of every command it runs",
    )
    files: list[FileIn] = Field(default_factory=list, description="Files to put in /work")
    context: Any = Field(
        default=None,
        description="A context (text, or any JSON) loaded as the variable `context`; for "
        "large ones, PUT /v1/sessions/{id}/context streams it",
    )
    snapshot: str | None = Field(
        default=None,
        description="Restore this snapshot (its variables, imports, files) into the new "
        "session; its profile is the snapshot's",
    )
    volumes: list[VolumeMountIn] = Field(
        default_factory=list,
        description="Your volumes it mounts (shared with other sessions that mount them, "
        "never saved with its snapshots); a snapshot's session mounts the snapshot's",
    )
    egress: str | EgressAsk | None = Field(
        default=None,
        description="Network egress: the name of one of the server's policies "
        "(--egress-policy), or {policy, allow} to narrow one to fewer hosts. Nothing: the "
        "server's `default` policy, if it has one; without it, no network",
    )
    metadata: dict[str, str] | None = Field(
        default=None,
        description="Labels of your choosing: string keys and values, at most 32 pairs and "
        "4 KiB (GET /v1/sessions?metadata.k=v finds them); from a snapshot, its session's "
        "when left out",
    )


class MetadataPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, str | None] = Field(
        description="Merged into the session's metadata; a null value deletes its key"
    )


class LastCell(BaseModel):
    number: int
    end_reason: str
    ended_at: float = Field(description="Unix time, s")


class CellOut(BaseModel):
    number: int = Field(description="Its place in the session's life, from 1")
    execution_count: int = Field(description="As the kernel counted it (a restart resets it)")
    code: str
    status: str = Field(description="ok, error, timeout, interrupted, killed")
    end_reason: str = Field(
        description="ok, error, timeout, interrupted, memory, output_limit, killed, sandbox_died"
    )
    started_at: float = Field(description="Unix time, s")
    ended_at: float = Field(description="Unix time, s")
    duration_s: float
    stdout: str = Field(description="Cut to the server's --history-output-bytes, with a marker")
    stderr: str
    result: dict[str, Any] | None = Field(description="MIME bundle of the last expression")
    displays: list[dict[str, Any]] = Field(description="MIME bundles it displayed")
    error: dict[str, Any] | None = Field(description="{ename, evalue, traceback}")
    files_changed: list[str]
    front_end: str = Field(description="Which front end sent it: http, tcp, mcp, jupyter, ui")
    message: str | None = Field(description="What cloche said about it (a limit, a loss)")
    kind: str = Field(
        default="cell",
        description="cell; command (a process: code is its command line); terminal",
    )
    exit_code: int | None = Field(default=None, description="A command's, when it exited")


class CellList(BaseModel):
    cells: list[CellOut]


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
    template: str = Field(default="python", description="The template its system is made of")
    state: str
    created_at: str = Field(description="ISO 8601, UTC")
    expires_at: str = Field(description="When it will be closed if left idle (ISO 8601, UTC)")
    execution_count: int
    egress: dict[str, Any] | None = Field(
        default=None, description="The egress policy it was given ({policy, allow?})"
    )
    metadata: dict[str, str] = Field(default_factory=dict, description="Its labels")
    last_cell: LastCell | None = Field(default=None, description="Its last cell, if any")
    queued_cells: int = Field(default=0, description="Cells waiting behind its running one")
    cpu_s: float | None = Field(
        default=None, description="CPU time its sandbox has used, s (in listings)"
    )
    memory_bytes: int | None = Field(
        default=None, description="Memory its sandbox holds now (in listings)"
    )
    volumes: list[VolumeMountIn] = Field(default_factory=list, description="What it mounts")
    limits: SessionLimits


class SessionList(BaseModel):
    sessions: list[SessionOut]


class SnapshotCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="", max_length=200, description="A name of your choosing")


class SnapshotOut(BaseModel):
    id: str
    session_id: str = Field(description="The session it was taken of")
    name: str
    profile: str
    created_at: str = Field(description="ISO 8601, UTC")
    size_bytes: int = Field(description="Its image and working directory on disk")
    execution_count: int


class SnapshotList(BaseModel):
    snapshots: list[SnapshotOut]


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: int = Field(default=1, ge=1, description="Copies to make (at most --max-fork)")


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    code: str = Field(description="Python to run in the session")
    timeout: float | None = Field(default=None, gt=0, description="Time limit of this cell, s")
    allow_stdin: bool = Field(
        default=False,
        description="With a streamed execute: input() and getpass() in the cell send an "
        "`input_request` event, answered by POST .../input; otherwise they raise in the cell",
    )


class InputRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: str = Field(description="The line that the cell's input() returns (no newline)")


class CellErrorOut(BaseModel):
    ename: str
    evalue: str
    traceback: list[str]


class ExecuteResponse(BaseModel):
    """Everything the cell produced (see the execution spec)."""

    status: Literal["ok", "error", "timeout", "interrupted", "killed"]
    end_reason: Literal[
        "ok", "error", "timeout", "interrupted", "memory", "output_limit", "killed", "sandbox_died"
    ] = Field(description="Finer than status: why the cell ended")
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


class InputResponse(BaseModel):
    answered: bool = Field(description="Whether an input() was waiting and got the value")


class InterruptResponse(BaseModel):
    interrupted: bool = Field(description="Whether a cell was running")


class FileOut(BaseModel):
    path: str
    size_bytes: int
    modified: float = Field(description="Unix time, s")


class FileList(BaseModel):
    files: list[FileOut]
    truncated: bool = Field(description="True when the listing stopped at its cap")


class ContextOut(BaseModel):
    kind: Literal["text", "json"] = Field(description="How the session loaded it")
    file: str = Field(description="The file in the working directory that holds it")
    size_bytes: int


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = Field(
        default=None, description="Text, or OpenAI content parts (their text parts are used)"
    )


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion request; other OpenAI fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(
        pattern=r"^rlm:",
        description="rlm:<model>: a Recursive Language Model over <model> (root and "
        "llm_query); rlm: alone uses the server's --llm-model",
    )
    messages: list[ChatMessage] = Field(
        min_length=1, description="The last user message is the query"
    )
    stream: bool = Field(default=False, description="Not supported: must be false")
    context: Any = Field(
        default=None,
        description="cloche's extension: the context (text, or any JSON), loaded as the "
        "variable `context`. Without it, a session that has one keeps it, and a new session "
        "gets the messages (one message's text, or the list of messages)",
    )

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, stream: bool) -> bool:
        if stream:
            raise ValueError("streaming is not supported by the RLM endpoint: send false")
        return stream


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatChoiceMessage
    finish_reason: Literal["stop", "length"] = Field(
        description="stop: the model gave FINAL; length: it was cut off after the last turn"
    )


class ChatUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    """OpenAI's chat completion; usage sums the root model's calls and llm_query's."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
