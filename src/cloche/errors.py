"""Every failure cloche raises, as one tree.

Errors in the *user's* code are not exceptions: they are data in a cell's result
(`CellResult.error`). What follows are failures of cloche itself or of a request::

    ClocheError
    ├── ConfigError                 a setting is invalid or the machine can't honour it
    │   ├── BackendUnavailable      runsc missing or unusable
    │   └── EgressConfigError       an --egress-policy or --secrets file that can't be used
    ├── ProtocolError               a peer broke the wire format
    │   ├── IncompleteRead          the stream ended inside a frame
    │   ├── FrameTooLarge           a declared length is above the limit
    │   └── InvalidMessage          a frame is not the JSON object expected
    ├── LLMError                    a language-model call failed (a cell sees it as LLMError)
    │   ├── LLMUnavailable          the server has no LLM backend (--llm-base-url)
    │   └── LLMBudgetExceeded       a session spent its budget (--llm-max-calls, ...)
    ├── PackageInstallError         `%pip install` refused or failed (a cell sees it as such)
    ├── CommandFailed               a command did not exit 0 and its caller asked so (check=True)
    ├── TemplateError               a template can't be built, found or used
    │   ├── TemplateNotFound        no template of that name
    │   ├── TemplateExists          one of that name is ready or being built (delete it first)
    │   ├── TemplateNotReady        it is still being built
    │   ├── TemplateFailed          its build failed: the builder's own lines say why
    │   ├── TemplateInUse           live or paused sessions use it (it can't be deleted)
    │   └── TemplateRefused         a bad name or source, or the built-in `python` (400)
    ├── VolumeError                 a volume can't be made, found, mounted or deleted
    │   ├── VolumeNotFound          the tenant has no volume of that name
    │   ├── VolumeExists            the tenant has one of that name already
    │   ├── VolumeInUse             live or paused sessions mount it (it can't be deleted)
    │   ├── VolumeRefused           a bad name, size or mount path (400)
    │   └── VolumeFull              a file written through the API would pass its size
    ├── SandboxError                a sandbox could not be started or was lost
    │   ├── SandboxStartError       it failed to start (after retries)
    │   └── KernelDied              it exited or broke the channel while in use
    ├── SessionError                a request about sessions can't be served
    │   ├── SessionNotFound         unknown, closed, expired, or someone else's
    │   ├── SessionLost             it was live when its server (or node) died, or can't be resumed
    │   ├── SessionMoved            it now lives on another node (cluster front ends look again)
    │   ├── SessionBusy             its queue of waiting cells is full
    │   ├── TooManySessions         the server is at --max-sessions
    │   ├── UnknownProfile          no session profile of that name
    │   ├── EgressRefused           egress asked beyond the server's policy (403)
    │   ├── SnapshotNotFound        unknown, deleted, or someone else's snapshot
    │   ├── CellNotFound            no cell of that number in a session's history
    │   ├── InvalidMetadata         a session's metadata of the wrong shape or too large
    │   ├── InvalidEnvironment      a session's env of the wrong shape or too large
    │   ├── NotSupported            this server (a cluster's front end, say) does not offer that
    │   ├── ProcessError            a command or terminal could not be started or reached
    │   │   └── ProcessNotFound     no running process of that pid in the session
    │   ├── PortUnreachable         nothing answers on a session's port (502), or its relay
    │   ├── RestoreRefused          an image that can't be restored (damaged, other runsc)
    │   ├── CheckpointFailed        a session could not be saved (it keeps running)
    │   │   └── StorageFull         --data-dir is at its budget, or its disk is full
    │   ├── TooManyPausedSessions   --max-paused-sessions are already on disk
    │   ├── ForkRefused             a fork asked for no copies, or more than --max-fork
    │   ├── NodeNotFound            no live node of that id in the cluster
    │   ├── Unauthorized            a token is required and was missing or wrong
    │   ├── Forbidden               the token's role may not do that (admin only)
    │   ├── QuotaExceeded           a tenant's quota (--tokens) had no room in --quota-wait
    │   └── PathRefused             a path in a working directory can't be read or written
    │       └── PathNotFound        nothing is there
    └── ClientError                 the client SDK got no usable answer from a server
        ├── ServerUnreachable       nothing answers at the URL (--url, CLOCHE_URL)
        ├── RequestTimeout          no answer in time (timeout_s, --request-timeout)
        ├── InvalidRequest          the server refused a request as malformed (400)
        ├── RequestTooLarge         a body above the server's --max-frame-bytes (413)
        └── UnexpectedResponse      an answer that is not the cloche API (wrong URL, a proxy)

The client SDK (`cloche.Client`, `cloche.AsyncClient`) raises the same classes as the
server for the same conditions: a 404 about a session is `SessionNotFound`, a 401 is
`Unauthorized`, a 403 `Forbidden`, a 429 is `TooManySessions` (`QuotaExceeded` over a
tenant's quota), a 503 is `SandboxError`; about templates, a 404 is `TemplateNotFound`, a 409
`TemplateExists`, `TemplateNotReady`, `TemplateFailed` or `TemplateInUse`, a 400
`TemplateRefused`, a 501 `NotSupported`; about volumes, a 404 is `VolumeNotFound`, a 409
`VolumeExists` or `VolumeInUse`, a 400 `VolumeRefused`, a 507 `VolumeFull`. What only a
client can meet is under `ClientError`.
"""

from __future__ import annotations

from typing import Any


class ClocheError(Exception):
    """Base of every exception cloche raises."""


class ConfigError(ClocheError):
    """A setting is invalid or this machine can't honour it."""


class BackendUnavailable(ConfigError):
    """The chosen sandbox backend can't run on this machine."""


class EgressConfigError(ConfigError):
    """An --egress-policy or --secrets file that can't be read or used."""


class ProtocolError(ClocheError):
    """A peer broke the wire format."""


class IncompleteRead(ProtocolError):
    """The stream ended in the middle of a frame."""


class FrameTooLarge(ProtocolError):
    """A frame declared a length above the configured maximum."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the limit of {limit} bytes")
        self.length = length
        self.limit = limit


class InvalidMessage(ProtocolError):
    """A frame is not valid UTF-8 JSON of the expected shape."""


class LLMError(ClocheError):
    """A language-model call failed: its endpoint failed, or it took too long."""


class LLMUnavailable(LLMError):
    """The server has no LLM backend configured."""


class LLMBudgetExceeded(LLMError):
    """A session spent one of its LLM budgets (calls, tokens, time)."""


class PackageInstallError(ClocheError):
    """Packages could not be installed into a session: refused by policy, unknown, no wheel
    for the sandbox, too large, or the index failed. The session is left as it was."""


class CommandFailed(ClocheError):
    """A command ended without exiting 0 (a non-zero exit, a signal, its timeout, a kill)
    and its caller asked for that to raise (`check=True`); without it, how a command ended
    is data (`CommandResult.exit_code`, `.status`).

    Attributes:
        result: the command's `CommandResult` (its output, exit code, status).
        command: the command line, as it was asked.
    """

    def __init__(self, result: Any, command: str = "") -> None:
        if result.exit_code is not None:
            how = f"exited with {result.exit_code}"
        else:
            how = f"ended: {result.status}" + (f" ({result.signal})" if result.signal else "")
        what = f"command {command!r}" if command else f"command {result.pid}"
        last = (result.stderr or result.stdout or "").strip().splitlines()[-1:]
        super().__init__(f"{what} {how}" + (f": {last[0][:200]}" if last else ""))
        self.result = result
        self.command = command


class TemplateError(ClocheError):
    """A template can't be built, found or used."""


class TemplateNotFound(TemplateError):
    """No template of that name (never built, or deleted)."""

    def __init__(self, name: str, why: str = "") -> None:
        super().__init__(f"Template {name} not found{why}")
        self.name = name


class TemplateExists(TemplateError):
    """A template of that name is ready or being built: delete it first."""


class TemplateNotReady(TemplateError):
    """The template is still being built; its sessions can start once it is ready."""


class TemplateFailed(TemplateError):
    """A template's build failed (or its record says it did): the message is the builder's
    own line (skopeo's, umoci's, docker's, or cloche's refusal naming the member)."""


class TemplateInUse(TemplateError):
    """Live or paused sessions use the template: it can't be deleted until they end."""


class TemplateRefused(TemplateError):
    """A request about templates refused as it stands: a bad name, a source that is not
    there or not offered, or the built-in template `python` (which can't be built over or
    deleted)."""


class VolumeError(ClocheError):
    """A volume can't be made, found, mounted or deleted."""


class VolumeNotFound(VolumeError):
    """The tenant has no volume of that name (never made, deleted, or another tenant's)."""

    def __init__(self, name: str, why: str = "") -> None:
        super().__init__(f"Volume {name} not found{why}")
        self.name = name


class VolumeExists(VolumeError):
    """The tenant has a volume of that name already: delete it first, or pick another."""


class VolumeInUse(VolumeError):
    """Live or paused sessions mount the volume: it can't be deleted until they end."""


class VolumeRefused(VolumeError):
    """A request about volumes refused as it stands: a bad name, a size out of bounds, a
    mount path that is not allowed."""


class VolumeFull(VolumeError):
    """A file written through the volumes API would take the volume past its size."""


class SandboxError(ClocheError):
    """A sandbox could not be started, or was lost."""


class SandboxStartError(SandboxError):
    """A sandbox failed to start."""


class KernelDied(SandboxError):
    """The kernel exited, was killed, or broke the channel protocol."""


class SessionError(ClocheError):
    """A request about sessions can't be served."""


class SessionNotFound(SessionError):
    """The session is unknown, closed, expired, or belongs to another token; or its
    sandbox died while it was asked (why says how)."""

    def __init__(self, session_id: str, why: str = "") -> None:
        super().__init__(
            f"Session {session_id} is gone: {why}" if why else f"Session {session_id} not found"
        )
        self.session_id = session_id


class SessionLost(SessionError):
    """The session existed but is gone for good: its server died while it was live, or its
    saved image could not be brought back. Not "not found": the client is told why."""

    def __init__(self, session_id: str, why: str = "when the server stopped unexpectedly") -> None:
        super().__init__(f"Session {session_id} was lost {why}")
        self.session_id = session_id


class SessionMoved(SessionError):
    """The session was moved to another node of the cluster (a drain); ask the directory."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"Session {session_id} moved to another node")
        self.session_id = session_id


class SessionBusy(SessionError):
    """Too many cells are already waiting for this session."""


class TooManySessions(SessionError):
    """The server already holds --max-sessions sessions."""


class UnknownProfile(SessionError):
    """No session profile has that name."""


class EgressRefused(SessionError):
    """A session asked for egress its server's policy does not give: an unknown policy,
    or a rule wider than the policy named."""


class SnapshotNotFound(SessionError):
    """The snapshot is unknown, deleted, or belongs to another token."""

    def __init__(self, snapshot_id: str) -> None:
        super().__init__(f"Snapshot {snapshot_id} not found")
        self.snapshot_id = snapshot_id


class CellNotFound(SessionError):
    """No cell of that number is in the session's history (never run, or no longer kept)."""

    def __init__(self, session_id: str, number: int) -> None:
        super().__init__(f"Session {session_id} has no cell {number} in its history")
        self.session_id = session_id
        self.number = number


class InvalidMetadata(SessionError):
    """Metadata that is not string keys and values within the limits (operations.md)."""


class InvalidEnvironment(SessionError):
    """Environment variables for a session of the wrong shape or too large."""


class NotSupported(SessionError):
    """What was asked is not offered by this server (a cluster's front end, a backend
    without it); the message says what is."""


class ProcessError(SessionError):
    """A command or terminal could not be started or reached: no such user or directory,
    a program that can't run, a process supervisor that is gone; the message says which."""


class ProcessNotFound(ProcessError):
    """No running process of that pid in the session (it ended, or never was)."""


class PortUnreachable(SessionError):
    """Nothing listens on a session's port, or the sandbox's port relay does not answer;
    the message names the port (or the relay)."""


class RestoreRefused(SessionError):
    """A saved image can't be restored: damaged, or made by another runsc or runtime."""


class CheckpointFailed(SessionError):
    """A session could not be saved to disk; it goes on running as it was."""


class StorageFull(CheckpointFailed):
    """--data-dir is at its budget (--data-max-mib), or its disk is full."""


class TooManyPausedSessions(SessionError):
    """--max-paused-sessions sessions are already paused on disk."""


class ForkRefused(SessionError):
    """A fork asked for no copies, or more than --max-fork."""


class NodeNotFound(SessionError):
    """No live node of that id in the cluster (or not in cluster mode)."""


class Unauthorized(SessionError):
    """A token is required and was missing or not accepted."""


class Forbidden(SessionError):
    """The caller's token is valid, but its role may not do that (an admin's verb)."""


class QuotaExceeded(SessionError):
    """A tenant is at one of its quotas (`--tokens` file) and no room came within
    --quota-wait seconds.

    Attributes:
        quota: the quota's name in the tokens file (`max_live_sessions`, ...).
        retry_after_s: when asking again makes sense, seconds.
    """

    def __init__(self, message: str, *, quota: str = "", retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.quota = quota
        self.retry_after_s = retry_after_s


class PathRefused(SessionError):
    """A path in a session's working directory is refused: unsafe, unusable, or too large."""

    def __init__(self, path: str, reason: str, code: str = "") -> None:
        super().__init__(f"path {path!r} refused: {reason}")
        self.path = path
        self.reason = reason
        self.code = code  # the errno's name (EACCES, EEXIST...) where the sandbox said it


class PathNotFound(PathRefused):
    """Nothing is at the path (or a directory on the way is missing)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, "no such file")


class ClientError(ClocheError):
    """The client SDK got no usable answer from a server."""


class ServerUnreachable(ClientError):
    """Nothing answers at the server's URL (refused, unresolvable, or reset)."""


class RequestTimeout(ClientError):
    """The server did not answer in time."""


class InvalidRequest(ClientError):
    """The server refused a request as malformed (HTTP 400)."""


class RequestTooLarge(ClientError):
    """A request body is above the server's --max-frame-bytes (HTTP 413)."""


class UnexpectedResponse(ClientError):
    """An answer that is not the cloche API's: a wrong URL, a proxy, a server fault."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
