"""The shipped Grafana dashboards and alert rules only query metrics the runtime, the operator and the gateway
export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.operator.metrics import OperatorMetrics
from kvfleet.runtime.metrics import ServerMetrics
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[1]
CHART_DASHBOARDS = ROOT / "charts" / "kvfleet" / "files" / "dashboards"
ALERTS = ROOT / "charts" / "kvfleet" / "files" / "alerts.yaml"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}

# dashboard (its path in the repository) -> (the registry its metrics come from, how its metric names look,
# one metric it must chart, its template variables)
DASHBOARDS = {
    "docs/grafana-dashboard.json": (
        lambda: ServerMetrics("m").registry,
        r"kvfleet:[a-z0-9_]+",
        "kvfleet:num_requests_waiting",  # the queue depth the autoscaler scales on
        {"datasource", "model_name"},
    ),
    "docs/grafana-operator-dashboard.json": (
        lambda: OperatorMetrics().registry,
        r"kvfleet_operator_[a-z0-9_]+",
        "kvfleet_operator_queue_depth",
        {"datasource", "namespace"},
    ),
    # The chart ships it as a ConfigMap (metrics.dashboards).
    "charts/kvfleet/files/dashboards/gateway.json": (
        lambda: GatewayMetrics().registry,
        r"kvfleet_gateway_[a-z0-9_]+",
        "kvfleet_gateway_queue_depth",
        {"datasource", "model"},
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
    dashboard = json.loads((ROOT / file_name).read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert expressions
    used = {name for expr in expressions for name in re.findall(pattern, expr)}
    assert not used - _exported_sample_names(registry()), "the dashboard queries metrics nobody exports"
    assert required in used
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {variable["name"] for variable in dashboard["templating"]["list"]} == variables


def test_the_chart_ships_every_dashboard_it_has() -> None:
    shipped = {f"charts/kvfleet/files/dashboards/{path.name}" for path in CHART_DASHBOARDS.glob("*.json")}
    assert shipped and shipped <= set(DASHBOARDS), "each shipped dashboard is checked above"


def test_alert_rules_query_exported_operator_metrics_and_say_what_fires() -> None:
    exported = _exported_sample_names(OperatorMetrics().registry)
    (group,) = yaml.safe_load(ALERTS.read_text())
    names = [rule["alert"] for rule in group["rules"]]
    assert len(names) == len(set(names)) and names
    for rule in group["rules"]:
        used = set(re.findall(r"kvfleet_operator_[a-z0-9_]+", rule["expr"]))
        assert used and not used - exported, f"{rule['alert']} queries metrics the operator does not export"
        assert rule["labels"]["severity"] in {"critical", "warning"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
