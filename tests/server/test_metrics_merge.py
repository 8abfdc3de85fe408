"""A cluster front end's /metrics: its own figures and each node's, one family per name."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cloche.server.collectors import merge


def node_text(cells: int, pooled: int) -> str:
    registry = CollectorRegistry()
    Counter("cloche_cells", "Cells run", ["status"], registry=registry).labels("ok").inc(cells)
    Gauge("cloche_sessions_pooled", "Ready", ["profile"], registry=registry).labels("lean").set(
        pooled
    )
    return generate_latest(registry).decode()


def test_each_node_s_figures_get_its_label_beside_the_front_end_s_own() -> None:
    own = CollectorRegistry()
    Counter("cloche_cells", "Cells run", ["status"], registry=own).labels("ok").inc(5)
    text = merge(generate_latest(own), {"n1": node_text(3, 2), "n2": node_text(4, 1)}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# TYPE cloche_cells_total counter") == 1  # one family, not three
    totals = {
        s.labels.get("node"): s.value
        for s in families["cloche_cells"].samples
        if s.name == "cloche_cells_total"
    }
    assert totals == {None: 5.0, "n1": 3.0, "n2": 4.0}
    pooled = {s.labels["node"]: s.value for s in families["cloche_sessions_pooled"].samples}
    assert pooled == {"n1": 2.0, "n2": 1.0}


def test_with_no_node_answering_it_is_the_front_end_s_own() -> None:
    own = CollectorRegistry()
    Gauge("cloche_x", "x", registry=own).set(1)
    assert "cloche_x 1.0" in merge(generate_latest(own), {}).decode()
