"""The server: one session manager, its front ends, and an orderly shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from cloche.config import ServerConfig
from cloche.sandbox.base import Backend
from cloche.sandbox.registry import create_backend
from cloche.server.events import Event, EventBus
from cloche.server.http import HTTPFrontEnd
from cloche.server.metrics import Metrics
from cloche.server.tcp import TCPFrontEnd
from cloche.server.tenants import Tenants
from cloche.server.webhooks import server_webhooks
from cloche.sessions.local import LocalSessionManager
from cloche.sessions.manager import SessionManager
from cloche.sessions.quotas import QuotaGate

if TYPE_CHECKING:
    from cloche.cluster.manager import ClusterSessionManager
    from cloche.llm.bridge import SessionsLLM
    from cloche.llm.broker import Broker
    from cloche.network.egress.service import Egress

log = logging.getLogger("cloche.server")


# Events after which a tenant may have room again (a close, a pause, a resume, a volume gone).
_ROOM_EVENTS = frozenset({"session.closed", "session.paused", "session.resumed", "volume.deleted"})


def _room_made(gate: QuotaGate, event: Event) -> None:
    """Wake the requests of the event's owner that wait for room, if it may have made some."""
    if event.type in _ROOM_EVENTS:
        gate.changed(event.owner_key)


def _policy_names(config: ServerConfig, tenants: Tenants) -> Collection[str] | None:
    """The server's egress policies (None: no --egress-policy), read only if a tenant
    names one."""
    if config.egress_policy is None or not any(t.terms.egress for t in tenants):
        return None
    from cloche.network.egress.policy import EgressConfig

    return EgressConfig.load(config.egress_policy).policies.keys()


def blocking_threads(config: ServerConfig) -> int:
    """Threads for blocking calls: a few per session that can be starting or closing at once
    (they mostly wait on runsc; an idle thread costs nothing)."""
    return min(1024, max(32, 2 * config.max_sessions))


def _broker(config: ServerConfig, metrics: Metrics) -> Broker | None:
    """The language-model broker, when the server has a model (--llm-base-url)."""
    if config.llm is None:
        return None
    from cloche.llm.broker import Broker

    return Broker(config.llm, metrics)


def _sessions_llm(broker: Broker | None, config: ServerConfig) -> SessionsLLM | None:
    """How a manager gives its sessions' cells `llm_query`: the broker, handed down."""
    if broker is None:
        return None
    from cloche.llm.bridge import SessionsLLM

    return SessionsLLM(broker, config.max_frame_bytes)


class Server:
    """`cloche serve`: TCP and HTTP front ends over one session manager."""

    def __init__(self, config: ServerConfig, backend: Backend | None = None) -> None:
        self.config = config
        # Who may call, in which role, on what terms (--tokens, --token, --admin-token).
        self.tenants = Tenants.load(config.tokens_file, config.tokens, config.admin_tokens)
        self.tenants.check_egress(_policy_names(config, self.tenants))
        self.backend: Backend | None = None
        self.egress: Egress | None = None  # with --egress-policy
        self.manager: LocalSessionManager | ClusterSessionManager
        # The language-model broker (llm_query, the RLM endpoint), with --llm-base-url.
        self.broker: Broker | None = None
        # What the layers below report through their observer (the metrics) as events goes
        # on to the bus, behind GET /v1/events and the webhooks.
        self.events = EventBus(config.events_buffer)
        self.metrics = Metrics(self.events.publish)
        deliveries = self.metrics.webhook_deliveries
        self.webhooks = server_webhooks(config, lambda outcome: deliveries.labels(outcome).inc())
        for tenant in self.tenants:  # a tenant's webhook gets its own sessions' events
            if tenant.webhook is not None and tenant.webhook_secret is not None:
                self.webhooks.add_receiver(tenant.webhook, tenant.webhook_secret, tenant.owner_key)
        self.events.listen(self.webhooks.offer)
        if config.cluster:  # sessions on the nodes of a Ray cluster: no sandbox here
            from cloche.cluster.manager import ClusterSessionManager

            self.manager = ClusterSessionManager(
                config, self.metrics, node_figures=Metrics, webhooks=self.webhooks.ids()
            )
            self.broker = _broker(config, self.metrics)  # the RLM endpoint's own calls
            self.metrics.watch_cluster(self.manager.cluster_view)
        else:
            self.backend = backend or create_backend(config)
            if config.egress_policy is not None:
                from cloche.network.egress.service import Egress

                audit = config.egress_audit or config.data_dir / "egress" / "audit.jsonl"
                self.egress = Egress.load(
                    config.egress_policy, audit, self.metrics.egress_record, config.egress_secrets
                )
            self.broker = _broker(config, self.metrics)
            self.manager = LocalSessionManager(
                config,
                self.backend,
                observer=self.metrics,
                egress=self.egress,
                llm=_sessions_llm(self.broker, config),
            )
            self.metrics.watch(self.manager)
        # What the front ends reach: the manager, behind the tenants' quotas if any has some.
        self.sessions: SessionManager = self.manager
        if self.tenants.gated:
            gate = QuotaGate(
                self.manager,
                self.tenants.terms_of,
                wait_s=config.quota_wait_s,
                observer=self.metrics,
                max_queued=config.max_queued_cells,
            )
            self.events.listen(lambda event: _room_made(gate, event))
            self.sessions = gate
        self.tcp = TCPFrontEnd(self.sessions, config, self.metrics, self.tenants)
        self.http: HTTPFrontEnd | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._stopped = False

    async def start(self) -> None:
        """Prepare the backend, start the pool, and listen. Fails fast on a bad setup."""
        # Sandbox starts and closes wait in threads (runsc subprocesses, a close's grace):
        # asyncio's default of cores + 4 threads made a burst's starts wait behind closes.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(blocking_threads(self.config), thread_name_prefix="cloche-blocking")
        )
        self.webhooks.start()
        await self.manager.start()
        try:
            await self.tcp.start()
            self.http = HTTPFrontEnd(self.sessions, self.config, self.metrics, self.tenants)
            self.http.app.state.broker = self.broker
            self.http.app.state.events = self.events
            self._http_task = asyncio.create_task(self.http.serve(), name="cloche-http")
        except BaseException:
            await self.stop()
            raise
        log.info(
            "cloche listening tcp=%s:%s http=%s:%s backend=%s pool=%d",
            self.config.host,
            self.tcp.port,
            self.config.host,
            self.http.port,
            self.backend.describe() if self.backend else f"cluster {self.config.cluster}",
            self.config.pool_size,
        )

    async def stop(self) -> None:
        """Stop accepting, interrupt cells, tear down every sandbox. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        log.info("shutting down")
        if self.http is not None:
            self.http.server.should_exit = True
        self.tcp.stop_accepting()
        await self.manager.stop()  # running cells end (interrupted), and their clients hear it
        self.events.close()  # event streams end (after what they had queued), so HTTP can drain
        await self.tcp.close()
        if self.http is not None:
            await self.http.stop()
        if self._http_task is not None:
            await asyncio.gather(self._http_task, return_exceptions=True)
        await self.webhooks.stop()
        if self.egress is not None:
            self.egress.close()
        if self.broker is not None:
            await self.broker.close()
        log.info("stopped")

    async def serve_forever(self) -> None:
        """Run until SIGTERM or SIGINT, then shut down cleanly."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.start()
            if self.config.cluster:  # Ray's core put its own handlers in: ours again
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, stop.set)
            await stop.wait()
        finally:
            await self.stop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
