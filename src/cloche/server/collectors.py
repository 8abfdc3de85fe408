"""What /metrics reads when scraped: a manager's live state, a cluster's nodes, and the
metrics of a cluster's nodes merged into its front end's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from cloche.sessions.local import LocalSessionManager


class ManagerCollector(Collector):
    """The live state of one machine's manager: its sessions, gate and pools."""

    def __init__(self, manager: LocalSessionManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        active = GaugeMetricFamily("cloche_sessions_active", "Sessions alive now")
        active.add_metric([], self.manager.session_count)
        yield active
        paused = GaugeMetricFamily("cloche_sessions_paused", "Sessions paused on disk")
        paused.add_metric([], self.manager.paused_count)
        yield paused
        stored = GaugeMetricFamily(
            "cloche_data_dir_bytes", "Bytes of images and archives in --data-dir"
        )
        stored.add_metric([], self.manager.store.used_bytes)
        yield stored
        yield from _volume_figures(self.manager)
        gate = self.manager.gate
        waiting = GaugeMetricFamily(
            "cloche_cells_waiting_turn",
            f"Cells waiting for their turn now ({gate.slots} run at once across sessions)",
        )
        waiting.add_metric([], gate.waiting)
        yield waiting
        overruns = CounterMetricFamily(
            "cloche_cell_slice_overruns",
            "Cells that ran past their slice, gave their turn up and ran on behind the others",
        )
        overruns.add_metric([], gate.overruns)
        yield overruns
        pooled = GaugeMetricFamily(
            "cloche_sessions_pooled",
            "Started sandboxes waiting in the warm pool",
            labels=["profile"],
        )
        hits = CounterMetricFamily(
            "cloche_pool_hits", "New sessions given a ready sandbox", labels=["profile"]
        )
        misses = CounterMetricFamily(
            "cloche_pool_misses",
            "New sessions that waited for a sandbox to start (the pool was empty)",
            labels=["profile"],
        )
        target = GaugeMetricFamily(
            "cloche_pool_target",
            "Ready sandboxes a pool aims for (its size, or more after bursts)",
            labels=["profile"],
        )
        for name, pool in self.manager.pools.items():
            pooled.add_metric([name], pool.ready_count)
            hits.add_metric([name], pool.hits)
            misses.add_metric([name], pool.misses)
            target.add_metric([name], pool.target)
        yield pooled
        yield hits
        yield misses
        yield target


def _volume_figures(manager: LocalSessionManager) -> Iterator[GaugeMetricFamily]:
    """How many volumes there are, their sizes together, and how many are mounted now."""
    every = manager.volume_store.all()
    count = GaugeMetricFamily("cloche_volumes", "Volumes kept in --volumes-dir")
    count.add_metric([], len(every))
    yield count
    size = GaugeMetricFamily("cloche_volume_bytes", "Sizes of the volumes together, bytes")
    size.add_metric([], sum(v.size_mib for v in every) * 2**20)
    yield size
    mounted = GaugeMetricFamily(
        "cloche_volumes_mounted", "Volumes mounted now (by sessions' sandboxes or file requests)"
    )
    mounted.add_metric([], manager.volume_store.mounted())
    yield mounted


class ClusterCollector(Collector):
    """Each node of a cluster, labelled `node`, from the cluster's view."""

    def __init__(self, view: Callable[[], dict[str, Any] | None]) -> None:
        self.view = view

    def collect(self) -> Iterator[GaugeMetricFamily]:
        view = self.view() or {"nodes": []}
        up = GaugeMetricFamily(
            "cloche_cluster_node_up",
            "1 while a node is alive, 0 when draining or dead",
            labels=["node", "state"],
        )
        sessions = GaugeMetricFamily(
            "cloche_cluster_node_sessions", "Live sessions on a node", labels=["node"]
        )
        paused = GaugeMetricFamily(
            "cloche_cluster_node_paused", "Sessions paused on a node's disk", labels=["node"]
        )
        pooled = GaugeMetricFamily(
            "cloche_cluster_node_pooled",
            "Started sandboxes ready in a node's pool",
            labels=["node", "profile"],
        )
        memory = GaugeMetricFamily(
            "cloche_cluster_node_memory_available_bytes",
            "Memory available on a node's machine",
            labels=["node"],
        )
        directory = GaugeMetricFamily(
            "cloche_cluster_directory_entries",
            "Sessions and snapshots the cluster's directory places (expired ones leave it)",
            labels=["kind"],
        )
        for kind, count in sorted(view.get("directory", {}).items()):
            directory.add_metric([kind], count)
        yield directory
        for node in view["nodes"]:
            up.add_metric([node["id"], node["state"]], 1 if node["state"] == "alive" else 0)
            sessions.add_metric([node["id"]], node["sessions"])
            paused.add_metric([node["id"]], node["paused"])
            memory.add_metric([node["id"]], node["memory_available_bytes"])
            for profile, ready in sorted(node["pool"].items()):
                pooled.add_metric([node["id"], profile], ready)
        yield from (up, sessions, paused, pooled, memory)


class _Families(Collector):
    """Families already made (parsed and merged), for one render."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge(own: bytes, nodes: dict[str, str]) -> bytes:
    """A cluster front end's exposition text and each node's (node id -> text), as one:
    families of the same name merged, each node's samples labelled `node`."""
    merged: dict[str, Metric] = {}
    for family in text_string_to_metric_families(own.decode()):
        merged[family.name] = family
    for node_id, text in sorted(nodes.items()):
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                into.samples.append(sample._replace(labels={**sample.labels, "node": node_id}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merged.values()))
    return generate_latest(registry)
