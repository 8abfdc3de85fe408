"""`cloche/__init__.py` is the one public surface: `__all__` is pinned, sorted and real."""

from __future__ import annotations

import re

import cloche

EXPECTED = [
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


def test_all_is_pinned():
    assert cloche.__all__ == EXPECTED


def test_all_is_sorted():
    assert cloche.__all__ == sorted(cloche.__all__)


def test_every_name_in_all_exists():
    for name in cloche.__all__:
        assert getattr(cloche, name) is not None, name


def test_every_exception_exported_is_in_the_one_tree():
    exported = [getattr(cloche, name) for name in cloche.__all__]
    errors = [item for item in exported if isinstance(item, type) and issubclass(item, Exception)]
    assert errors and all(issubclass(error, cloche.ClocheError) for error in errors)


def test_the_tree_drawn_in_the_docstring_names_every_error_class():
    import cloche.errors

    classes = [
        name
        for name, item in vars(cloche.errors).items()
        if isinstance(item, type) and issubclass(item, cloche.errors.ClocheError)
    ]
    assert cloche.errors.__doc__ is not None
    for name in classes:
        assert re.search(rf"[─ ]{name}\s", cloche.errors.__doc__), name
