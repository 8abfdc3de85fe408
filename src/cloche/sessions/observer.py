"""What the layers below the front ends report: the observer they are given.

The session manager, its warm pools, the package installer and the language-model broker
tell an `Observer` what happened; this one forgets it. The server gives them its
Prometheus metrics instead (`cloche.server.metrics.Metrics` overrides every method), so
metrics are observed from above and never imported from below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from cloche.sessions.result import CellResult


class EventSink(Protocol):
    """Where `Observer.event` goes on to (the server's event bus; a node agent's outbox)."""

    def __call__(
        self,
        kind: str,
        session_id: str | None,
        owner_key: str | None,
        data: dict[str, Any],
        webhooks: frozenset[str] | None = None,
    ) -> object: ...


class Observer:
    """Told about sessions, cells, sandboxes, images, installs and LLM calls; does nothing."""

    # -- events (operations.md: the bus behind /v1/events and webhooks) --------------------

    def event(
        self,
        kind: str,
        session_id: str | None,
        owner_key: str | None,
        data: dict[str, Any],
        webhooks: frozenset[str] | None = None,
    ) -> None:
        """Something an operator may be told about happened.

        Args:
            kind: `session.created`, `session.paused`, `session.resumed`, `session.forked`,
                `session.snapshotted`, `session.closed`, `cell.started`, `cell.finished`,
                `quota.exceeded`, `node.up`, `node.draining`, `node.dead`, `volume.created`,
                `volume.deleted`.
            session_id: the session it is about, if any.
            owner_key: the hash of the owner's token (`sessions.session.owner_key`), if any.
            data: JSON-ready details (e.g. `end_reason`, `execution_count`, `profile`).
            webhooks: the webhook receivers (by `Receiver.id`) this server delivers it to;
                None: all of them. A cluster's front ends all tell the events of its nodes,
                and each delivers one only to the receivers it claimed it for, so that each
                receiver gets it once (`cluster/relay.py`, `cluster/nodes.py`).
        """

    # -- sandboxes and sessions -----------------------------------------------------------

    def sandbox_started(self, profile: str, seconds: float) -> None:
        """A sandbox of profile started and loaded its profile in seconds."""

    def sandbox_start_failed(self, profile: str) -> None:
        """A sandbox of profile failed to start."""

    def session_created(self, profile: str) -> None:
        """A session of profile was made (new, from a snapshot, or a fork's copy)."""

    def session_closed(self, reason: str, end_reason: str = "closed") -> None:
        """A session ended, for reason (closed, idle, lost, killed, ...); end_reason is the
        typed one of operations.md (closed, idle_timeout, oom_killed, sandbox_died, ...)."""

    def cell_finished(self, result: CellResult, seconds: float) -> None:
        """A cell ended as result after seconds of wall time, as the manager saw it."""

    # -- durability -----------------------------------------------------------------------

    def command_finished(self, end_reason: str, seconds: float) -> None:
        """A command or terminal of a session ended (end_reason: CommandResult's)."""

    def session_paused(self, reason: str, image_bytes: int) -> None:
        """A session was saved to disk (reason: request, idle, room, shutdown)."""

    def session_resumed(self, seconds: float) -> None:
        """A paused session was restored into a new sandbox in seconds."""

    def resume_failed(self) -> None:
        """A paused session could not be restored (it is lost)."""

    def snapshot_taken(self, image_bytes: int) -> None:
        """A snapshot of a session was written."""

    def snapshot_restored(self, seconds: float) -> None:
        """A new session was restored from a snapshot in seconds."""

    def fork_image_saved(self, image_bytes: int) -> None:
        """A running session's image was written for a fork."""

    def forked(self, copies: int, seconds: float) -> None:
        """A fork restored its copies in seconds."""

    # -- packages -------------------------------------------------------------------------

    def package_install(
        self, outcome: str, seconds: float, downloaded: int, cached: int, written_bytes: int
    ) -> None:
        """An install into a session ended (outcome: ok, refused, error)."""

    # -- language models ------------------------------------------------------------------

    def llm_call(
        self,
        model: str,
        kind: str,
        outcome: str,
        seconds: float,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        """An LLM call ended (kind: sub, a cell's llm_query; root, an RLM run's)."""

    def llm_refused(self, budget: str) -> None:
        """An LLM call was refused: a session spent its budget (calls, tokens, time)."""

    def rlm_run(self, outcome: str) -> None:
        """An RLM run ended (outcome: ok, cut_off, error)."""

    def rlm_turns(self, iterations: int) -> None:
        """An RLM run that returned took iterations root-model turns."""
