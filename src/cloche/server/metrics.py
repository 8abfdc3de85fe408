"""Prometheus metrics: sessions, cells, sandbox starts, limit breaches, rejected requests.

Each server has its own registry (several servers may live in one process, as in tests).
Counters and histograms are fed by the layers below as their `Observer` (the session
manager, pools, installer and LLM broker) and by the front ends; gauges are read from the
manager when scraped (`collectors.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cloche.server.collectors import ClusterCollector, ManagerCollector
from cloche.sessions.observer import EventSink, Observer

if TYPE_CHECKING:
    from cloche.sessions.local import LocalSessionManager
    from cloche.sessions.result import CellResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_CELL_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)
_WAIT_BUCKETS_S = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_START_BUCKETS_S = (0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30)
_LLM_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class Metrics(Observer):
    """The metrics of one server."""

    def __init__(self, events: EventSink | None = None) -> None:
        """events: where `Observer.event` goes on to (the server's event bus)."""
        self._events = events
        self.registry = CollectorRegistry(auto_describe=True)
        self.sessions_created = Counter(
            "cloche_sessions_created", "Sessions created", ["profile"], registry=self.registry
        )
        self.sessions_closed = Counter(
            "cloche_sessions_closed",
            "Sessions closed, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.cells = Counter(
            "cloche_cells", "Cells run, by how they ended", ["status"], registry=self.registry
        )
        # The typed reasons of operations.md, finer than status and reason above.
        self.cell_ends = Counter(
            "cloche_cell_ends",
            "Cells ended, by end_reason (ok, error, timeout, interrupted, memory, "
            "output_limit, killed, sandbox_died)",
            ["end_reason"],
            registry=self.registry,
        )
        self.session_ends = Counter(
            "cloche_session_ends",
            "Sessions ended, by end_reason (closed, idle_timeout, lifetime, oom_killed, "
            "sandbox_died, node_lost, server_crashed, restart_failed)",
            ["end_reason"],
            registry=self.registry,
        )
        self.cell_duration = Histogram(
            "cloche_cell_duration_seconds",
            "Wall time of cells as the server saw it",
            ["status"],
            buckets=_CELL_BUCKETS_S,
            registry=self.registry,
        )
        self.command_ends = Counter(
            "cloche_command_ends",
            "Commands and terminals of sessions ended, by end_reason (ok, error, signaled, "
            "timeout, killed, output_limit, sandbox_died)",
            ["end_reason"],
            registry=self.registry,
        )
        self.command_duration = Histogram(
            "cloche_command_duration_seconds",
            "Wall time of sessions' commands and terminals",
            buckets=_CELL_BUCKETS_S,
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "cloche_cell_queue_wait_seconds",
            "Time a cell waited to run: behind its session's earlier cells, then for its turn",
            buckets=_WAIT_BUCKETS_S,
            registry=self.registry,
        )
        self.sandbox_start = Histogram(
            "cloche_sandbox_start_seconds",
            "Time to start a sandbox and load its profile",
            ["profile"],
            buckets=_START_BUCKETS_S,
            registry=self.registry,
        )
        self.sandbox_start_failures = Counter(
            "cloche_sandbox_start_failures",
            "Sandbox starts that failed",
            ["profile"],
            registry=self.registry,
        )
        self.limit_breaches = Counter(
            "cloche_limit_breaches",
            "Limits hit by cells, by kind",
            ["kind"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "cloche_rejected_requests",
            "Requests refused, by front end and reason",
            ["frontend", "reason"],
            registry=self.registry,
        )
        # Language models (llm_query and RLM runs). Labelled by model (at most 16 names,
        # then "other"), never by session: a session's spending is in the logs.
        self.llm_calls = Counter(
            "cloche_llm_calls",
            "LLM calls, by model, kind (sub: a cell's llm_query; root: an RLM run's) and outcome",
            ["model", "kind", "outcome"],
            registry=self.registry,
        )
        self.llm_latency = Histogram(
            "cloche_llm_call_duration_seconds",
            "Wall time of LLM calls",
            ["model", "kind"],
            buckets=_LLM_BUCKETS_S,
            registry=self.registry,
        )
        self.llm_tokens = Counter(
            "cloche_llm_tokens",
            "Tokens of LLM calls as the endpoint reported them, by model and kind",
            ["model", "kind"],
            registry=self.registry,
        )
        self.llm_budget_refusals = Counter(
            "cloche_llm_budget_refusals",
            "LLM calls refused because a session spent a budget (calls, tokens, time)",
            ["budget"],
            registry=self.registry,
        )
        self.rlm_runs = Counter(
            "cloche_rlm_runs",
            "RLM runs (POST /v1/chat/completions), by how they ended",
            ["outcome"],
            registry=self.registry,
        )
        self.rlm_iterations = Histogram(
            "cloche_rlm_iterations",
            "Root-model turns of RLM runs",
            buckets=(1, 2, 3, 5, 8, 13, 20, 30, 50),
            registry=self.registry,
        )
        # `%pip install` and POST /v1/sessions/{id}/packages.
        self.package_installs = Counter(
            "cloche_package_installs",
            "Package installs into sessions, by outcome (ok, refused, error)",
            ["outcome"],
            registry=self.registry,
        )
        self.package_install_duration = Histogram(
            "cloche_package_install_duration_seconds",
            "Wall time of package installs (resolve, download, unpack)",
            buckets=_LLM_BUCKETS_S,
            registry=self.registry,
        )
        self.package_wheels = Counter(
            "cloche_package_wheels",
            "Wheels installed into sessions, by source (download, cache)",
            ["source"],
            registry=self.registry,
        )
        self.package_bytes = Counter(
            "cloche_package_bytes",
            "Bytes of package files written into sessions' site directories",
            registry=self.registry,
        )

        # Durability: sessions saved to disk and brought back.
        self.pauses = Counter(
            "cloche_session_pauses",
            "Sessions paused to disk, by reason (request, idle, room, shutdown)",
            ["reason"],
            registry=self.registry,
        )
        self.resumes = Counter(
            "cloche_session_resumes",
            "Paused sessions brought back, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.snapshots = Counter("cloche_snapshots", "Snapshots taken", registry=self.registry)
        self.forks = Counter("cloche_fork_copies", "Sessions made by forks", registry=self.registry)
        self.image_bytes = Counter(
            "cloche_image_bytes",
            "Bytes of checkpoint images written, by kind (pause, snapshot, fork)",
            ["kind"],
            registry=self.registry,
        )
        self.restore_time = Histogram(
            "cloche_restore_seconds",
            "Time to restore a sandbox from an image, by kind (resume, snapshot, fork)",
            ["kind"],
            buckets=_START_BUCKETS_S,
            registry=self.registry,
        )

        # The Jupyter kernel gateway (/api): its REST requests and its websockets.
        self.jupyter_requests = Counter(
            "cloche_jupyter_requests",
            "Kernel gateway REST requests, by route and status code",
            ["route", "status"],
            registry=self.registry,
        )
        self.jupyter_connections = Gauge(
            "cloche_jupyter_connections",
            "Kernel gateway websocket connections open now",
            registry=self.registry,
        )
        # Egress: one record per connection through a session's door.
        self.egress_connections = Counter(
            "cloche_egress_connections",
            "Connections through sessions' egress doors, by decision "
            "(allowed, refused, unreachable, bad-request, error)",
            ["decision"],
            registry=self.registry,
        )
        self.egress_refusals = Counter(
            "cloche_egress_refusals",
            "Egress connections refused, by reason (denied, not-allowed, address, self, limit)",
            ["reason"],
            registry=self.registry,
        )
        self.egress_bytes = Counter(
            "cloche_egress_bytes",
            "Bytes carried by egress connections, by direction (up: to the host named)",
            ["direction"],
            registry=self.registry,
        )

        # Ports: requests and websockets carried to servers in sessions (or refused).
        self.port_requests = Counter(
            "cloche_port_requests",
            "Requests through sessions' ports, by kind (http, websocket) and status class "
            "(1xx-5xx: the server's answer, or cloche's own refusal)",
            ["kind", "status"],
            registry=self.registry,
        )
        self.port_bytes = Counter(
            "cloche_port_bytes",
            "Body bytes carried through sessions' ports, by direction (in: to the server)",
            ["direction"],
            registry=self.registry,
        )

        # Webhooks: each attempt that failed and is tried again, each event delivered,
        # each given up (retry time spent, the receiver's queue full, the server stopped).
        self.webhook_deliveries = Counter(
            "cloche_webhook_deliveries",
            "Webhook deliveries, by outcome (delivered; retried: an attempt failed and is "
            "tried again; dropped: given up)",
            ["outcome"],
            registry=self.registry,
        )
        # A cluster node's events that no front end took before its outbox (the last
        # --events-buffer of them) was full.
        self.node_events_dropped = Counter(
            "cloche_node_events_dropped",
            "Events of a cluster node dropped before any front end took them",
            registry=self.registry,
        )

    def events_dropped(self, count: int) -> None:
        """Count events a cluster node dropped before a front end took them."""
        self.node_events_dropped.inc(count)

    def port_exchange(self, kind: str, status: int, bytes_in: int, bytes_out: int) -> None:
        """Count one request (or websocket) through a session's port."""
        self.port_requests.labels(kind, f"{status // 100}xx" if status else "none").inc()
        if bytes_in:
            self.port_bytes.labels("in").inc(bytes_in)
        if bytes_out:
            self.port_bytes.labels("out").inc(bytes_out)

    def egress_record(self, record: dict[str, Any]) -> None:
        """Count one egress record (what `cloche.network.egress` writes to its audit file)."""
        self.egress_connections.labels(record.get("decision", "error")).inc()
        if record.get("decision") == "refused":
            self.egress_refusals.labels(record.get("reason", "unknown")).inc()
        for direction in ("up", "down"):
            carried = record.get(f"bytes_{direction}", 0)
            if carried:
                self.egress_bytes.labels(direction).inc(carried)

    # -- what the layers below report (Observer) -------------------------------------------

    def event(
        self,
        kind: str,
        session_id: str | None,
        owner_key: str | None,
        data: dict[str, Any],
        webhooks: frozenset[str] | None = None,
    ) -> None:
        if self._events is not None:
            self._events(kind, session_id, owner_key, data, webhooks)

    def sandbox_started(self, profile: str, seconds: float) -> None:
        self.sandbox_start.labels(profile).observe(seconds)

    def sandbox_start_failed(self, profile: str) -> None:
        self.sandbox_start_failures.labels(profile).inc()

    def session_created(self, profile: str) -> None:
        self.sessions_created.labels(profile).inc()

    def session_closed(self, reason: str, end_reason: str = "closed") -> None:
        self.sessions_closed.labels(reason).inc()
        self.session_ends.labels(end_reason).inc()

    def cell_finished(self, result: CellResult, seconds: float) -> None:
        status = result.status.value
        self.cells.labels(status).inc()
        self.cell_ends.labels(result.end_reason).inc()
        self.cell_duration.labels(status).observe(seconds)
        self.queue_wait.observe(result.queue_wait_s)
        for kind in breaches(result):
            self.limit_breaches.labels(kind).inc()

    def command_finished(self, end_reason: str, seconds: float) -> None:
        self.command_ends.labels(end_reason).inc()
        self.command_duration.observe(seconds)

    def session_paused(self, reason: str, image_bytes: int) -> None:
        self.pauses.labels(reason).inc()
        self.image_bytes.labels("pause").inc(image_bytes)

    def session_resumed(self, seconds: float) -> None:
        self.resumes.labels("ok").inc()
        self.restore_time.labels("resume").observe(seconds)

    def resume_failed(self) -> None:
        self.resumes.labels("failed").inc()

    def snapshot_taken(self, image_bytes: int) -> None:
        self.snapshots.inc()
        self.image_bytes.labels("snapshot").inc(image_bytes)

    def snapshot_restored(self, seconds: float) -> None:
        self.restore_time.labels("snapshot").observe(seconds)

    def fork_image_saved(self, image_bytes: int) -> None:
        self.image_bytes.labels("fork").inc(image_bytes)

    def forked(self, copies: int, seconds: float) -> None:
        self.forks.inc(copies)
        self.restore_time.labels("fork").observe(seconds)

    def package_install(
        self, outcome: str, seconds: float, downloaded: int, cached: int, written_bytes: int
    ) -> None:
        self.package_installs.labels(outcome).inc()
        self.package_install_duration.observe(seconds)
        self.package_wheels.labels("download").inc(downloaded)
        self.package_wheels.labels("cache").inc(cached)
        self.package_bytes.inc(written_bytes)

    def llm_call(
        self,
        model: str,
        kind: str,
        outcome: str,
        seconds: float,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        self.llm_calls.labels(model, kind, outcome).inc()
        self.llm_latency.labels(model, kind).observe(seconds)
        self.llm_tokens.labels(model, "prompt").inc(prompt_tokens)
        self.llm_tokens.labels(model, "completion").inc(completion_tokens)

    def llm_refused(self, budget: str) -> None:
        self.llm_budget_refusals.labels(budget).inc()

    def rlm_run(self, outcome: str) -> None:
        self.rlm_runs.labels(outcome).inc()

    def rlm_turns(self, iterations: int) -> None:
        self.rlm_iterations.observe(iterations)

    # -- the server's own -------------------------------------------------------------------

    def watch(self, manager: LocalSessionManager) -> None:
        """Report the manager's live state (sessions, pools) at each scrape."""
        self.registry.register(ManagerCollector(manager))

    def watch_cluster(self, view: Callable[[], dict[str, Any] | None]) -> None:
        """Report each node of a cluster (labelled `node`) at each scrape."""
        self.registry.register(ClusterCollector(view))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def breaches(result: CellResult) -> list[str]:
    """The limits a cell hit: timeout, memory, output, killed."""
    kinds = []
    if result.status.value == "timeout":
        kinds.append("timeout")
    if result.error is not None and result.error.get("ename") == "MemoryError":
        kinds.append("memory")
    if result.dropped_bytes:
        kinds.append("output")
    if result.status.value == "killed":
        kinds.append("killed")
    return kinds
