"""The Grafana dashboard (deploy/grafana/baton.json) asks only for what Baton exports: every
metric its queries name, and every label they match or group by, is read from the
registries of the metrics module itself, as a scrape would see them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from baton.runtime.metrics import GatewayMetrics, WorkerMetrics
from engine import statistics
from engine.statistics import EngineStats, RecentStats

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "baton.json"
# Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = {"instance", "job"}
# The sample names prometheus_client writes for a family, by its type.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "info": ("_info",),
            "gauge": ("",), "unknown": ("",)}
# PromQL's words that are not metric names (functions are told by the "(" after them).
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool"}


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every sample name the gateway and a worker expose, with the label names of its series."""
    gateway = GatewayMetrics("m")
    gateway.watch_in_flight(lambda front: 0)
    worker = WorkerMetrics("m", "decode")
    # A speculating engine: its per-position families have a series each (labelled position).
    speculating = EngineStats(num_speculative_tokens=2, spec_proposed_by_position=(2, 1),
                              spec_accepted_by_position=(1, 0))
    engine = SimpleNamespace(**statistics.values(speculating, EngineStats), recent=RecentStats(),
                             spec_acceptance_rate=speculating.spec_acceptance_rate,
                             spec_speedup=speculating.spec_speedup)
    worker.watch_engine(lambda: engine)
    worker.record_transfer("ipc", 1, 0.1)  # the labelled families get a series each
    worker.record_transfer_failure("ipc")
    names: dict[str, set[str]] = {}
    for registry in (gateway.registry, worker.registry):
        for family in registry.collect():
            labels = names.setdefault(family.name, set())
            for suffix in SUFFIXES[family.type]:
                names.setdefault(family.name + suffix, set())
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
                labels.update(sample.labels)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, and the variables' queries."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        # label_values(metric, label): a query of `metric`, grouped by `label`.
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"]).groups()
        queries.append((f"${variable['name']}", f"sum by ({label}) ({metric})"))
    return queries


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)  # label matchers, ranges
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    words = re.findall(r"(?<![\w.$])([a-zA-Z_:][\w:]*)\b(?!\s*\()", bare)
    return {word for word in words if word not in KEYWORDS}


def label_names(expr: str) -> set[str]:
    """The labels an expression matches on, groups by or joins on (those of `$__rate_interval` aside)."""
    matched = {name for matchers in re.findall(r"\{([^}]*)\}", expr)
               for name in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers)}
    clauses = re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr)
    grouped = {name.strip() for clause in clauses for name in clause.split(",") if name.strip()}
    return matched | grouped


def test_the_dashboard_is_grafana_json_with_a_prometheus_input():
    dashboard = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    sources = [p["datasource"] for p in dashboard["panels"] if p["type"] != "row"]
    sources += [t["datasource"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert sources and all(s == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"} for s in sources)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p.get("targets") for p in dashboard["panels"] if p["type"] != "row")


def test_every_metric_the_dashboard_queries_is_exported(exported):
    missing = []
    for title, expr in dashboard_queries():
        names = metric_names(expr)
        assert names, (title, expr)
        missing += [(title, name) for name in names if name not in exported]
    assert missing == []


def test_every_label_the_dashboard_reads_is_on_a_series_it_queries(exported):
    unknown = []
    for title, expr in dashboard_queries():
        labels = set.union(*(exported[name] for name in metric_names(expr))) | TARGET_LABELS
        unknown += [(title, label) for label in label_names(expr) if label not in labels]
    assert unknown == []


def test_the_dashboard_shows_what_an_operator_tunes_by(exported):
    """Request rate, the in-flight gauge, the latency histograms and their phases, the KV
    cache, queues and transfers: each named by some panel."""
    queried = {name for _, expr in dashboard_queries() for name in metric_names(expr)}
    for name in ("baton_requests_received_total", "baton_requests_in_flight",
                 "baton_time_to_first_token_seconds_bucket", "baton_inter_token_latency_seconds_bucket",
                 "baton_time_to_second_token_seconds_bucket", "baton_request_phase_seconds_bucket",
                 "baton_kv_cache_usage_ratio", "baton_num_requests_waiting", "baton_kv_transferred_bytes_total",
                 "baton_kv_transfer_failures_total"):
        assert name in queried, name
    # The phase panels group by the label that takes each phase's name; in flight, by front end.
    assert "phase" in exported["baton_request_phase_seconds_bucket"]
    assert "front" in exported["baton_requests_in_flight"]


def test_the_checks_read_promql_as_meant():
    expr = ('histogram_quantile(0.9, sum by (le, phase) (rate(baton_x_bucket{model_name=~"$model_name"}'
            '[$__rate_interval]))) / rate(process_y[5m]) * on (instance) group_left (role) baton_build_info')
    assert metric_names(expr) == {"baton_x_bucket", "process_y", "baton_build_info"}
    assert label_names(expr) == {"le", "phase", "model_name", "instance", "role"}
