"""The shipped Grafana dashboards only query metrics the runtime and the operator really export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from kvfleet.operator.metrics import OperatorMetrics
from kvfleet.runtime.metrics import ServerMetrics
from prometheus_client import CollectorRegistry

DOCS = Path(__file__).resolve().parents[1] / "docs"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}

# dashboard -> (the registry its metrics come from, how its metric names look, one metric it must chart,
# its template variables)
DASHBOARDS = {
    "grafana-dashboard.json": (
        lambda: ServerMetrics("m").registry,
        r"kvfleet:[a-z0-9_]+",
        "kvfleet:num_requests_waiting",  # the queue depth the autoscaler scales on
        {"datasource", "model_name"},
    ),
    "grafana-operator-dashboard.json": (
        lambda: OperatorMetrics().registry,
        r"kvfleet_operator_[a-z0-9_]+",
        "kvfleet_operator_queue_depth",
        {"datasource", "namespace"},
    ),
}


def _exported_sample_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


@pytest.mark.parametrize("file_name", sorted(DASHBOARDS))
def test_dashboard_queries_exported_metrics(file_name: str) -> None:
    registry, pattern, required, variables = DASHBOARDS[file_name]
    dashboard = json.loads((DOCS / file_name).read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert expressions
    used = {name for expr in expressions for name in re.findall(pattern, expr)}
    assert not used - _exported_sample_names(registry()), "the dashboard queries metrics nobody exports"
    assert required in used
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {variable["name"] for variable in dashboard["templating"]["list"]} == variables
