"""The shipped Grafana dashboard only queries metrics the server really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvfleet.runtime.metrics import ServerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exported_sample_names() -> set[str]:
    names = set()
    for family in ServerMetrics("m").registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def test_dashboard_queries_exported_kvfleet_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert expressions
    used = {name for expr in expressions for name in re.findall(r"kvfleet:[a-z0-9_]+", expr)}
    assert not used - _exported_sample_names(), "the dashboard queries metrics the server does not export"
    # The queue depth the autoscaler scales on is on the dashboard.
    assert "kvfleet:num_requests_waiting" in used
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {variable["name"] for variable in dashboard["templating"]["list"]} == {"datasource", "model_name"}
