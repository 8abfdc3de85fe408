"""A cluster front end's /metrics: its own figures, and every node's, labelled `node`.

Each node agent renders its own Prometheus registry (sandboxes, pools, cells, pauses); the
front end fetches them at scrape time and merges families of the same name, so that
`cloche_cells_total{node="..."}` sits beside the front end's unlabelled requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge(own: bytes, nodes: dict[str, str]) -> bytes:
    """The front end's exposition text and each node's (node id -> text), as one."""
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
