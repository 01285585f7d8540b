"""The Grafana dashboard of the chart: every panel's PromQL asks for metrics the code exports (found in
the metric definitions of scheduler/metrics.py and runner/service/server.py, with the suffixes
Prometheus gives each kind), it covers what an operator of a pool looks at, and the chart ships it in a
ConfigMap for Grafana's sidecar only when asked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "charts" / "lorafleet" / "dashboards" / "lorafleet.json"
SOURCES = [REPO / "scheduler" / "metrics.py", REPO / "runner" / "service" / "server.py"]
KINDS = {"Counter": "counter", "CounterMetricFamily": "counter", "Histogram": "histogram", "Gauge": "gauge",
         "GaugeMetricFamily": "gauge", "g": "gauge"}  # server.py names GaugeMetricFamily `g`
METRIC = re.compile(r"\b(lorafleet_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def defined_metrics() -> dict[str, str]:
    """name (a regex where the name is an f-string) -> kind, from the definitions in the code."""
    found = {}
    for src in SOURCES:
        for kind, name in re.findall(r"\b(\w+)\(\s*f?\"((?:lorafleet_|vllm:)[^\"]+)\"", src.read_text()):
            if kind in KINDS:
                found[re.sub(r"\{\w+\}", r"[a-z0-9_]+", name)] = KINDS[kind]
    return found


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def is_exported(series: str) -> bool:
    """A series name Prometheus scrapes from the code's metrics (client_python's suffix per kind)."""
    return any(re.fullmatch(pattern + suffix, series)
               for pattern, kind in defined_metrics().items() for suffix in SUFFIXES[kind])


def exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_the_definitions_are_found():
    defs = defined_metrics()
    # one of each source and kind, so a change in how metrics are written fails here, not silently
    assert defs["lorafleet_generation_tokens"] == "counter"
    assert defs["lorafleet_time_to_first_token_seconds"] == "histogram"
    assert defs["lorafleet_queue_length"] == "gauge"
    assert defs["vllm:kv_cache_usage_perc"] == "gauge"
    assert defs["lorafleet_runner_adapter_[a-z0-9_]+"] == "counter"


def test_is_exported_knows_the_kinds():
    assert is_exported("lorafleet_generation_tokens_total") and not is_exported("lorafleet_generation_tokens")
    assert is_exported("lorafleet_queue_length") and not is_exported("lorafleet_queue_length_total")
    assert is_exported("lorafleet_runner_adapter_loads_total") and is_exported("lorafleet_ttft_nothing") is False
    assert is_exported("lorafleet_time_per_output_token_seconds_bucket")


def test_every_query_asks_for_exported_series():
    assert exprs()
    for title, expr in exprs():
        names = METRIC.findall(expr)
        assert names, f"{title}: {expr} queries no lorafleet metric"
        for name in names:
            assert is_exported(name), f"panel {title!r}: {name} is not a series the code exports ({expr})"
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        for name in re.findall(r"rate\(([\w:]+)", expr):  # rates only of counters and histogram buckets
            assert name.endswith(("_total", "_bucket")), f"{title}: rate of a gauge {name}"


def test_panels_cover_what_a_pool_operator_watches():
    joined = " ".join(f"{t} {e}" for t, e in exprs())
    for needed in ("lorafleet_generation_tokens_total", "histogram_quantile(0.5, sum by (le) (rate("
                   "lorafleet_time_to_first_token_seconds_bucket", "histogram_quantile(0.99, sum by (le) (rate("
                   "lorafleet_time_per_output_token_seconds_bucket", "lorafleet_queue_length",
                   "vllm:kv_cache_usage_perc", "lorafleet_runner_adapters_resident", "lorafleet_runner_adapters_loading",
                   "sum by (model) (rate(lorafleet_model_sequences_total", "lorafleet_migrations_total",
                   "sum by (model) (rate(lorafleet_model_generation_tokens_total",
                   "lorafleet_runner_healthy", "lorafleet_runner_busy_seconds_total"):
        assert needed in joined, needed
    dash = json.loads(DASHBOARD.read_text())
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "namespace"}


def test_scheduler_exposition_has_the_dashboards_names():
    """The scheduler's own registry, scraped: counters end in _total, histograms have buckets."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from lorafleet.scheduler.metrics import SchedulerMetrics

    m = SchedulerMetrics()
    req = SimpleNamespace(model="pirate", arrival=0.0, first_token_time=0.5, generated=[1, 2, 3])
    m.observe_finished(req, "stop")
    text = generate_latest(m.registry).decode()
    for series in ('lorafleet_model_sequences_total{model="pirate"} 1.0', "lorafleet_generation_tokens_total 3.0",
                   'lorafleet_model_generation_tokens_total{model="pirate"} 3.0',
                   "lorafleet_time_to_first_token_seconds_bucket", "lorafleet_time_per_output_token_seconds_bucket"):
        assert series in text, series


# --- the chart ---------------------------------------------------------------------------------


def render(helm, *sets):
    from helm_helpers import run_helm

    args = ["template", "lf", str(REPO / "charts" / "lorafleet"), "--namespace", "lorafleet-system"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(run_helm(helm, *args).stdout) if d]


def test_chart_ships_the_dashboard_only_when_enabled(helm):
    assert not [d for d in render(helm) if d["kind"] == "ConfigMap"]
    docs = render(helm, "metrics.grafanaDashboard.enabled=true", "metrics.grafanaDashboard.namespace=monitoring")
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert json.loads(cm["data"]["lorafleet.json"]) == json.loads(DASHBOARD.read_text())
