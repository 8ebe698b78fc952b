"""deploy/grafana/csd-serve.json, without a running service: valid JSON, a templated datasource, every metric
it names is one the service exports, every panel the issue asks for is there, and every PromQL expression
parses (promtool). The live check, a real Prometheus scraping the real service, is test_dashboard_live.py."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from tests.deploy.support import (
    GRAFANA_BUILTINS,
    KNOWN_SERIES,
    TEMPLATE_VARIABLE,
    dashboard_panels,
    dashboard_queries,
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
