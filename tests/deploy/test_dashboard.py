"""deploy/grafana/csd-serve.json, without a running service: valid JSON, a templated datasource, every metric
it names is one the service exports and every metric the service's registry exports is on a panel, every panel
the issue asks for is there, counters are read as rates, and every PromQL expression parses (promtool). The
live check, a real Prometheus scraping the real service, is test_dashboard_live.py."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from tests.deploy.support import (
    GRAFANA_BUILTINS,
    KNOWN_SERIES,
    NOT_ON_A_DASHBOARD,
    TEMPLATE_VARIABLE,
    dashboard_panels,
    dashboard_queries,
    exported_registry,
    exposition_families,
    families_on_no_dashboard,
    instantiate,
    load_dashboard,
    metric_names,
    require_tool,
)

DASHBOARD = load_dashboard()
PANELS = dashboard_panels(DASHBOARD)
QUERIES = dashboard_queries(DASHBOARD)

# What the issue asks the dashboard to show, as the series each must read (all of them, in one panel).
REQUIRED = {
    "acceptance rate, strict and with rescues": {
        "vllm:spec_decode_num_accepted_tokens_total",
        "csd_spec_decode_num_rescued_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total",
    },
    "mean acceptance length": {
        "vllm:spec_decode_num_accepted_tokens_total",
        "csd_spec_decode_num_rescued_tokens_total",
        "vllm:spec_decode_num_drafts_total",
    },
    "rescue rate": {"csd_spec_decode_num_rescued_tokens_total", "vllm:spec_decode_num_draft_tokens_total"},
    "per-position survival": {
        "csd_spec_decode_num_kept_tokens_per_pos_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "vllm:spec_decode_num_drafts_total",
    },
    "mean tokens per target forward": {"vllm:generation_tokens_total", "csd_target_forwards_total"},
    "tokens per second": {"vllm:generation_tokens_total"},
    "time to first token": {"vllm:time_to_first_token_seconds_bucket"},
    "inter-token latency": {"vllm:inter_token_latency_seconds_bucket"},
    "queue time": {"vllm:request_queue_time_seconds_bucket"},
    "prompt length": {"vllm:request_prompt_tokens_bucket"},
    "generation length": {"vllm:request_generation_tokens_bucket"},
    "finish reason": {"vllm:request_success_total"},
    "running and waiting requests": {"vllm:num_requests_running", "vllm:num_requests_waiting"},
    "batch occupancy": {"vllm:kv_cache_usage_perc"},
    "429 and 5xx": {"csd_requests_total"},
    "OCM store health": {"csd_ocm_store_healthy"},
    "flush latency": {"csd_ocm_flush_seconds_sum", "csd_ocm_flush_seconds_count"},
    "buffered and dropped increments": {"csd_ocm_buffered_increments", "csd_ocm_dropped_increments_total"},
    "pattern count": {"csd_ocm_patterns"},
    # issue 35: every exported metric on a panel
    "tokens per target forward, distribution": {"csd_tokens_per_target_forward_bucket"},
    "draft head in use": {"csd_draft_head_info"},
    "draft head reloads": {"csd_draft_head_reloads_total"},
    "OCM restores": {"csd_ocm_restores_total", "csd_ocm_restored_increments_total"},
    "time per output token": {"vllm:request_time_per_output_token_seconds_bucket"},
    "prefill and decode time": {
        "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_decode_time_seconds_bucket",
    },
    "prefix cache hit rate": {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"},
}


def _panel_series(panel: dict) -> set[str]:
    return set().union(*(metric_names(t["expr"]) for t in panel.get("targets", [])))


def _panel_exprs(panel: dict) -> str:
    return "\n".join(t["expr"] for t in panel.get("targets", []))


def test_every_metric_the_dashboard_names_is_exported():
    named = set().union(*(metric_names(expr) for _, expr in QUERIES))
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] == "query":
            named |= metric_names(variable["query"]["query"])
    unknown = named - KNOWN_SERIES
    assert not unknown, f"the service exports no such series: {sorted(unknown)}"


@pytest.mark.parametrize("topic", sorted(REQUIRED))
def test_the_panels_the_issue_asks_for_are_there(topic):
    panels = [p for p in PANELS if REQUIRED[topic] <= _panel_series(p)]
    assert panels, f"no panel shows {topic}"
    exprs = "\n".join(_panel_exprs(p) for p in panels)
    if topic in ("time to first token", "inter-token latency", "queue time"):
        assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs
    if topic in ("acceptance rate, strict and with rescues", "mean acceptance length"):
        # side by side: one query without rescues (vLLM's definition), one with them
        (panel,) = panels
        strict = [t for t in panel["targets"] if "rescued" not in t["expr"]]
        rescues = [t for t in panel["targets"] if "rescued" in t["expr"]]
        assert strict and rescues, f"{topic}: strict and with-rescues queries side by side"
    if topic == "mean acceptance length":
        assert all(t["expr"].startswith("1 + ") for t in panels[0]["targets"]), (
            "vLLM's: 1 + accepted / drafts"
        )
    if topic in ("prompt length", "generation length"):
        assert panels[0]["type"] == "heatmap"
    if topic == "running and waiting requests":
        assert "by (instance)" in exprs, "operators look per instance (pod) first"
    if topic in (
        "acceptance rate, strict and with rescues",
        "mean acceptance length",
        "rescue rate",
        "per-position survival",
        "mean tokens per target forward",
    ):
        assert "by (method, drafter" in exprs, f"{topic} must be shown per method and drafter"
    if topic == "per-position survival":
        assert "position" in exprs
    if topic == "429 and 5xx":
        assert 'status_code="429"' in exprs and 'status_code=~"5.."' in exprs
    if topic == "tokens per target forward, distribution":
        assert panels[0]["type"] == "heatmap"
    if topic == "draft head in use":
        # an info metric: its value is always 1, the identity label is the fact; count replicas per head
        assert "count by (identity)" in exprs
    if topic in ("time per output token", "prefill and decode time"):
        assert "histogram_quantile(0.5," in exprs


def test_every_metric_the_service_exports_is_on_a_dashboard(tmp_path):
    """The registry the service builds (its metrics, the OCM and traffic collectors) against every panel of
    every dashboard under deploy/grafana: a new metric without a panel fails here. The live test checks the
    same on a real server's /metrics, the draft head's metrics included."""
    from prometheus_client import generate_latest

    from service.traffic import TrafficRecorder

    recorder = TrafficRecorder(tmp_path / "traffic", max_bytes=1 << 20)  # records nothing: its counters only
    try:
        families = exposition_families(generate_latest(exported_registry(recorder)).decode())
    finally:
        recorder.close()
    assert {"csd_traffic_records", "csd_ocm_restores", "csd_tokens_per_target_forward"} <= set(families)
    assert families_on_no_dashboard(families) == [], "exported, but on no dashboard panel"
    # the exceptions are exported (a stale one would hide nothing) and the check can fail
    assert set(NOT_ON_A_DASHBOARD) <= set(families)
    assert families_on_no_dashboard({"csd_new_thing": {"csd_new_thing_total"}}) == ["csd_new_thing"]


COUNTER_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def _misread_series(expr: str) -> list[str]:
    """Series an expression reads the wrong way: a counter's (or a histogram's) series means something only
    through rate() or increase(); a gauge's value is the fact, and rate() of a gauge is wrong."""
    problems = []
    for match in re.finditer(r"\b((?:csd_|vllm:)[a-z0-9_:]+)\{", expr):
        series, before = match.group(1), expr[: match.start()]
        as_rate = re.search(r"\b(?:rate|increase)\(\s*$", before) is not None
        if series.endswith(COUNTER_SUFFIXES) and not as_rate:
            problems.append(f"the counter {series} read without rate() or increase()")
        elif not series.endswith(COUNTER_SUFFIXES) and as_rate:
            problems.append(f"the gauge {series} read through rate()")
    return problems


def test_counters_are_read_as_rates_and_gauges_as_values():
    problems = [f"{title}: {problem}" for title, expr in QUERIES for problem in _misread_series(expr)]
    assert not problems, "\n".join(problems)
    # the check can fail, both ways
    assert _misread_series('sum(csd_target_forwards_total{model_name="m"})')
    assert _misread_series('sum(rate(vllm:num_requests_running{model_name="m"}[5m]))')


def test_every_query_follows_the_model_and_instance_variables():
    """Operators pick a model and a pod (instance) first: every query selects on both."""
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["instance"]["query"]["query"] == "label_values(vllm:num_requests_running, instance)"
    assert variables["model_name"]["query"]["query"] == "label_values(vllm:num_requests_running, model_name)"
    for title, expr in QUERIES:
        assert expr.count('instance=~"$instance"') == expr.count("{"), f"{title}: {expr}"
        assert expr.count('model_name=~"$model_name"') == expr.count("{"), f"{title}: {expr}"


def test_datasource_is_templated():
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    reference = {"type": "prometheus", "uid": "${datasource}"}
    for panel in PANELS:
        assert panel["datasource"] == reference, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == reference, panel["title"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == reference
            assert re.fullmatch(r"label_values\([\w:]+, ?\w+\)", variable["query"]["query"])


def test_every_template_variable_used_is_defined():
    defined = {v["name"] for v in DASHBOARD["templating"]["list"]} | GRAFANA_BUILTINS
    for title, expr in QUERIES:
        used = {m.group(1) or m.group(2) for m in TEMPLATE_VARIABLE.finditer(expr)}
        assert used <= defined, f"{title}: undefined variables {used - defined}"


def test_layout_is_sound():
    ids = [p["id"] for p in DASHBOARD["panels"]] + [p["id"] for p in PANELS if p not in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    boxes = []
    for panel in DASHBOARD["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, panel["title"]
        for other_title, o in boxes:
            overlap = (
                g["x"] < o["x"] + o["w"]
                and o["x"] < g["x"] + g["w"]
                and g["y"] < o["y"] + o["h"]
                and o["y"] < g["y"] + g["h"]
            )
            assert not overlap, f"{panel['title']} overlaps {other_title}"
        boxes.append((panel["title"], g))
    for panel in PANELS:
        assert panel["targets"], f"{panel['title']} has no query"
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        assert panel.get("description"), f"{panel['title']} needs a description (what the number means)"


def _promtool_check(exprs: list[str], tmp_path) -> subprocess.CompletedProcess:
    promtool = require_tool("promtool", "Debian package prometheus")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:query{i}", "expr": e} for i, e in enumerate(exprs)],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


def test_every_expression_parses(tmp_path):
    """promtool parses each query (template variables at their "All" values) as a recording rule."""
    exprs = [instantiate(expr, DASHBOARD, "5m") for _, expr in QUERIES]
    proc = _promtool_check(exprs, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in proc.stdout
    broken = _promtool_check(["sum by (method (rate(csd_target_forwards_total[5m]))"], tmp_path)
    assert broken.returncode != 0  # the check can fail
