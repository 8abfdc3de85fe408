"""cloche: a fast, stateful, gVisor-isolated Python sandbox for LLM agents.

The client SDK, for a server started with `cloche serve`:

    import cloche

    with cloche.Client("http://127.0.0.1:8080") as client:
        with client.create_session() as session:
            session.run("import math")
            print(session.run("math.pi").text)

    cloche.run("print('one cell, in a fresh session')")

`AsyncClient` and `AsyncSession` are the same API for asyncio. Errors in the user's code are
data (`Execution.error`); failures of the server or the connection raise exceptions of the
tree drawn in `cloche.errors`, all subclasses of `ClocheError`.
"""

__version__ = "0.1.0"

from cloche.client.aio import AsyncClient, AsyncSession  # noqa: E402
from cloche.client.commands import AsyncCommands, ProcessInfo  # noqa: E402
from cloche.client.execution import Cell, Execution, ExecutionError, Logs, Result  # noqa: E402
from cloche.client.info import FileInfo, SessionInfo, SnapshotInfo  # noqa: E402
from cloche.client.ports import PreviewURL  # noqa: E402
from cloche.client.process import AsyncProcess, CommandResult  # noqa: E402
from cloche.client.sync import Client, Session, run  # noqa: E402
from cloche.client.sync_processes import Commands, Process, Terminal  # noqa: E402
from cloche.client.terminal import AsyncTerminal  # noqa: E402
from cloche.client.tool import tool_schema  # noqa: E402
from cloche.client.volumes import VolumeInfo  # noqa: E402
from cloche.errors import (  # noqa: E402
    CellNotFound,
    CheckpointFailed,
    ClientError,
    ClocheError,
    CommandFailed,
    EgressRefused,
    Forbidden,
    InvalidMetadata,
    InvalidRequest,
    LLMBudgetExceeded,
    LLMError,
    LLMUnavailable,
    NotSupported,
    PackageInstallError,
    PathNotFound,
    PathRefused,
    PortUnreachable,
    ProcessError,
    ProcessNotFound,
    QuotaExceeded,
    RequestTimeout,
    RequestTooLarge,
    RestoreRefused,
    SandboxError,
    ServerUnreachable,
    SessionBusy,
    SessionLost,
    SessionNotFound,
    SnapshotNotFound,
    StorageFull,
    TemplateError,
    TemplateExists,
    TemplateFailed,
    TemplateInUse,
    TemplateNotFound,
    TemplateNotReady,
    TemplateRefused,
    TooManyPausedSessions,
    TooManySessions,
    Unauthorized,
    UnexpectedResponse,
    VolumeError,
    VolumeExists,
    VolumeFull,
    VolumeInUse,
    VolumeNotFound,
    VolumeRefused,
)

__all__ = [
    "AsyncClient",
    "AsyncCommands",
    "AsyncProcess",
    "AsyncSession",
    "AsyncTerminal",
    "Cell",
    "CellNotFound",
    "CheckpointFailed",
    "Client",
    "ClientError",
    "ClocheError",
    "CommandFailed",
    "CommandResult",
    "Commands",
    "EgressRefused",
    "Execution",
    "ExecutionError",
    "FileInfo",
    "Forbidden",
    "InvalidMetadata",
    "InvalidRequest",
    "LLMBudgetExceeded",
    "LLMError",
    "LLMUnavailable",
    "Logs",
    "NotSupported",
    "PackageInstallError",
    "PathNotFound",
    "PathRefused",
    "PortUnreachable",
    "PreviewURL",
    "Process",
    "ProcessError",
    "ProcessInfo",
    "ProcessNotFound",
    "QuotaExceeded",
    "RequestTimeout",
    "RequestTooLarge",
    "RestoreRefused",
    "Result",
    "SandboxError",
    "ServerUnreachable",
    "Session",
    "SessionBusy",
    "SessionInfo",
    "SessionLost",
    "SessionNotFound",
    "SnapshotInfo",
    "SnapshotNotFound",
    "StorageFull",
    "TemplateError",
    "TemplateExists",
    "TemplateFailed",
    "TemplateInUse",
    "TemplateNotFound",
    "TemplateNotReady",
    "TemplateRefused",
    "Terminal",
    "TooManyPausedSessions",
    "TooManySessions",
    "Unauthorized",
    "UnexpectedResponse",
    "VolumeError",
    "VolumeExists",
    "VolumeFull",
    "VolumeInUse",
    "VolumeInfo",
    "VolumeNotFound",
    "VolumeRefused",
    "__version__",
    "run",
    "tool_schema",
]
