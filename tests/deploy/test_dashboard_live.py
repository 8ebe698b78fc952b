"""The real check of the dashboard: a real Prometheus (the Debian package, run from its binary with a temporary
config and a free port) scrapes the real service (`python -m service.cli serve` on the embedded model, the OCM
in a throwaway password-protected redis-server) after it served requests of several methods, a burst that hit
the queue bound, streaming, draft head reloads (one refused) and traffic recording; then every PromQL expression
of the dashboard must return data, every metric the service exports must be on a panel, and the template
variables' queries and the prometheus-adapter rule the autoscaler depends on must return data too. So must the tools
written for vLLM, unchanged: the main panels of vLLM's own Grafana dashboard and the KEDA / prometheus-adapter
rules on vLLM's queue metric (tests/deploy/fixtures/)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.support import (
    DEPLOY,
    K8S,
    REPO,
    dashboard_panels,
    dashboard_queries,
    dockerfile_instructions,
    exposition_families,
    families_on_no_dashboard,
    free_port,
    instantiate,
    load_dashboard,
    metric_names,
    redis_server,
    require_tool,
)

# One service start, a few short generations and a Prometheus: about a minute on an idle 2-core machine; the
# limit leaves room for a machine busy with other work. Marked slow in tests/slow_tests.py.
pytestmark = pytest.mark.timeout(1800)

FIXTURES = Path(__file__).parent / "fixtures"

SCRAPE_INTERVAL_S = 1


def rate_interval(live: dict) -> str:
    """A rate() window that reaches back past Prometheus's start, however long the module has run: a fixed
    window shorter than a slow run (a busy machine) sees no increase, and a ratio of rates becomes 0/0."""
    return f"{int(time.monotonic() - live['started']) + 60}s"


PROMPTS = [
    "Rewrite in American spelling: The colour of the theatre's centre stage was grey, and the organisers "
    "apologised for the delay of the programme.",
    "Repeat this list exactly: red apples, green pears, yellow lemons, red apples, green pears.",
]
# The labels a ServiceMonitor scrape gives a pod's series, for the prometheus-adapter rule.
POD_LABELS = {"namespace": "csd-test", "pod": "csd-serve-test-0"}
REDIS_PASSWORD = "live-test-password"


def _wait_for(
    check, timeout_s: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None
):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-4000:] if log else ""
            pytest.fail(f"{what}: the process exited with {proc.returncode}\n{tail}", pytrace=False)
        try:
            value = check()
            if value:
                return value
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    tail = log.read_text()[-4000:] if log else ""
    pytest.fail(f"timed out waiting for {what}\n{tail}", pytrace=False)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Prometheus:
    def __init__(self, url: str):
        self.client = httpx.Client(base_url=url, timeout=30)

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query, evaluated now or at `at` (unix seconds: queries compared with each other must
        share one instant, or their rates' extrapolation differs in the last digits)."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        body = self.client.get("/api/v1/query", params=params).json()
        assert body["status"] == "success", f"{expr}: {body.get('error')}"
        return body["data"]["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        body = self.client.get(f"/api/v1/label/{label}/values", params={"match[]": match}).json()
        assert body["status"] == "success", body
        return body["data"]

    def series(self, match: str) -> list[dict]:
        body = self.client.get("/api/v1/series", params={"match[]": match}).json()
        assert body["status"] == "success", body
        return body["data"]


def _ask(client: httpx.Client, model: str, prompt: str, *, speculative=None, stream=False, chat=True):
    body = {"model": model, "max_tokens": 16, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if speculative:
        body["speculative"] = speculative
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        return client.post(path, json=body).status_code
    with client.stream("POST", path, json=body) as response:
        events = [line for line in response.iter_lines() if line.startswith("data:")]
        if response.status_code == 200:
            assert events and events[-1].strip() == "data: [DONE]"
        return response.status_code


def _traffic(client: httpx.Client, model: str) -> list[int]:
    """Requests of every method (csd is the server default; sd and vanilla per request), streaming and not,
    chat and completions, then a burst beyond the queue bound. Returns the burst's status codes."""
    assert _ask(client, model, PROMPTS[0]) == 200
    assert _ask(client, model, PROMPTS[1], stream=True) == 200
    assert _ask(client, model, PROMPTS[0], chat=False, speculative={"method": "sd"}) == 200
    assert _ask(client, model, PROMPTS[1], speculative={"method": "vanilla"}) == 200
    with ThreadPoolExecutor(max_workers=6) as pool:
        return list(pool.map(lambda i: _ask(client, model, PROMPTS[i % 2]), range(6)))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    if not (REPO / "service" / "api").exists():
        pytest.skip("service/api (the HTTP service, issue 4) is not merged yet; this test runs once it is")
    prometheus_bin = require_tool("prometheus", "Debian package prometheus")
    tmp = tmp_path_factory.mktemp("live")

    redis_port = free_port()
    redis_args = [
        "--port",
        str(redis_port),
        "--dir",
        str(tmp),
        "--appendonly",
        "yes",
        "--requirepass",
        REDIS_PASSWORD,
    ]
    with redis_server(tmp / "redis", redis_args, redis_port):
        redis_url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_port}/0"
        from ocm_store.factory import open_store

        try:
            open_store(redis_url, tmp / "probe.sqlite").close()
        except NotImplementedError:
            pytest.skip("the Redis OCM backend (issue 3) is not merged yet: the OCM store panels need it")

        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("CSD_")}
        env.update(
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            CSD_HOST="127.0.0.1",
            CSD_REDIS_URL=redis_url,
            CSD_OCM_PATH=str(tmp / "ocm.sqlite"),
            CSD_LAMBDA="0",  # rescue from the first sighting of a pattern, so that rescues happen in a short run
            CSD_MAX_QUEUE="1",  # with CSD_MAX_BATCH_SIZE 2, the burst of 6 must meet 429s
            CSD_MAX_BATCH_SIZE="2",
            CSD_OCM_FLUSH_INTERVAL_S="0.05",
            CSD_RECORD_TRAFFIC=str(tmp / "traffic"),  # the traffic-recording panels need its metrics
        )
        service_log = tmp / "service.log"
        with open(service_log, "w") as log:
            service = subprocess.Popen(
                [sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        client = httpx.Client(base_url=base, timeout=600)
        prometheus = None
        try:
            _wait_for(lambda: client.get("/ready").status_code == 200, 600, "/ready", service, service_log)

            config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
            config["global"]["scrape_interval"] = f"{SCRAPE_INTERVAL_S}s"
            (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "csd-serve"]
            job["scrape_interval"] = f"{SCRAPE_INTERVAL_S}s"
            job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"], "labels": POD_LABELS}]
            (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
            prometheus_port = free_port()
            prometheus_log = tmp / "prometheus.log"
            with open(prometheus_log, "w") as log:
                prometheus = subprocess.Popen(
                    [
                        prometheus_bin,
                        f"--config.file={tmp / 'prometheus.yml'}",
                        f"--storage.tsdb.path={tmp / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{prometheus_port}",
                    ],
                    stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            prom = Prometheus(f"http://127.0.0.1:{prometheus_port}")
            started = time.monotonic()
            _wait_for(
                lambda: prom.client.get("/-/ready").status_code == 200,
                60,
                "Prometheus",
                prometheus,
                prometheus_log,
            )
            _wait_for(
                lambda: prom.query('up{job="csd-serve"} == 1'),
                60,
                "the first scrape",
                prometheus,
                prometheus_log,
            )

            model = client.get("/v1/models").json()["data"][0]["id"]
            # Two rounds with scrapes in between: counters must move after their series first appear, or
            # rate() sees no increase.
            burst = _traffic(client, model)
            time.sleep(3 * SCRAPE_INTERVAL_S)
            # the head reload panel: a reload of the running head's own folder, and one refused
            assert client.post("/v1/admin/reload_drafter", json={}).status_code == 200
            refused = client.post("/v1/admin/reload_drafter", json={"folder": str(tmp / "no-head")})
            assert refused.status_code == 400, refused.text
            burst += _traffic(client, model)
            time.sleep(3 * SCRAPE_INTERVAL_S + 1)
            metrics_text = client.get("/metrics").text
            yield {
                "prom": prom,
                "port": port,
                "burst": burst,
                "metrics": metrics_text,
                "log": service_log,
                "started": started,
            }
        finally:
            client.close()
            if prometheus is not None:
                _stop(prometheus)
            _stop(service)


def _finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in result)


def test_every_dashboard_expression_returns_data(live):
    dashboard = load_dashboard()
    failures = []
    for title, expr in dashboard_queries(dashboard):
        result = live["prom"].query(instantiate(expr, dashboard, rate_interval(live)))
        if not result:
            failures.append(f"{title}: no series for {expr}")
        elif not _finite(result):
            failures.append(f"{title}: only NaN/Inf for {expr}: {result}")
    assert not failures, "\n".join(failures)


def test_rates_are_shown_per_method(live):
    dashboard = load_dashboard()
    (panel,) = [p for p in dashboard_panels(dashboard) if p["title"].startswith("Acceptance rate: strict")]
    rates = {}
    now = time.time()
    for target in panel["targets"]:
        result = live["prom"].query(instantiate(target["expr"], dashboard, rate_interval(live)), at=now)
        kind = target["legendFormat"].split(" {{")[0]
        rates[kind] = {s["metric"].get("method"): float(s["value"][1]) for s in result}
        assert {"csd", "sd"} <= set(rates[kind]), f"{kind} acceptance per method: {result}"
        for series in result:
            # a ratio of two rates: PromQL's float arithmetic may land a hair above 1 when every draft was kept
            assert 0.0 <= float(series["value"][1]) <= 1.0 + 1e-9, series
    # side by side: strict (vLLM's) never exceeds the rate with rescues, and is equal where nothing is rescued
    assert set(rates) == {"strict", "with rescues"}
    for method, strict in rates["strict"].items():
        assert strict <= rates["with rescues"][method] + 1e-9, rates
    assert math.isclose(rates["strict"]["sd"], rates["with rescues"]["sd"]), rates


def test_rejections_show_in_the_429_share(live):
    assert 429 in live["burst"], f"the burst beyond CSD_MAX_QUEUE met no 429: {live['burst']}"
    dashboard = load_dashboard()
    (expr,) = [e for _, e in dashboard_queries(dashboard) if 'status_code="429"' in e]
    (series,) = live["prom"].query(instantiate(expr, dashboard, rate_interval(live)))
    assert float(series["value"][1]) > 0


def test_template_variables_have_values(live):
    dashboard = load_dashboard()
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        metric, label = variable["query"]["query"][len("label_values(") : -1].replace(" ", "").split(",")
        values = live["prom"].label_values(label, metric)
        assert values, f"${variable['name']} would list nothing"
        if label == "method":
            assert {"csd", "sd", "vanilla"} <= set(values)


def test_every_metric_the_dashboard_names_is_exported_by_the_service(live):
    exported = {s.name for family in text_string_to_metric_families(live["metrics"]) for s in family.samples}
    dashboard = load_dashboard()
    named = set().union(*(metric_names(expr) for _, expr in dashboard_queries(dashboard)))
    assert named <= exported, f"not in /metrics: {sorted(named - exported)}"


def test_every_metric_the_service_exports_is_on_a_dashboard(live):
    """The real server's /metrics (the draft head's and the traffic recorder's metrics included) against
    every panel of every dashboard under deploy/grafana; the static twin in test_dashboard.py reads the
    registry without a server."""
    families = exposition_families(live["metrics"])
    # the server ran with what the newer panels show, so their families are in this exposition
    assert {
        "csd_draft_head_info",
        "csd_draft_head_reloads",
        "csd_traffic_records",
        "csd_ocm_restores",
    } <= set(families)
    assert families_on_no_dashboard(families) == [], "exported, but on no dashboard panel"


def _panel_values(live, title: str, at: float) -> dict[str, float]:
    """Each query's value of a panel at one instant, by its legend with the labels filled in."""
    dashboard = load_dashboard()
    (panel,) = [p for p in dashboard_panels(dashboard) if p["title"] == title]
    values = {}
    for target in panel["targets"]:
        result = live["prom"].query(instantiate(target["expr"], dashboard, rate_interval(live)), at=at)
        for series in result:
            legend = target["legendFormat"]
            for label, value in series["metric"].items():
                legend = legend.replace("{{" + label + "}}", value)
            values[legend] = float(series["value"][1])
    return values


def test_the_draft_head_panels_show_the_head_and_its_reloads(live):
    now = time.time()
    (identity,) = [s["metric"]["identity"] for s in live["prom"].query("csd_draft_head_info")]
    assert _panel_values(live, "Draft head in use", now) == {identity: 1.0}  # one replica, one head
    reloads = _panel_values(live, "Draft head reloads", now)
    assert reloads["ok"] >= 1 and reloads["failed"] >= 1, reloads  # the fixture's reload and its refused one


def test_the_traffic_panels_show_the_recording(live):
    now = time.time()
    assert set(_panel_values(live, "Traffic recording", now).values()) == {1.0}
    recorded = _panel_values(live, "Generations recorded and dropped", now)
    assert recorded["recorded"] > 0, recorded
    assert recorded["dropped: queue_full"] == 0, recorded
    assert sum(_panel_values(live, "Recorded bytes written", now).values()) > 0


def test_the_autoscaler_metric_reaches_the_adapter_rule(live):
    """The prometheus-adapter rule's two queries, with the adapter's template filled in as it would for the
    HorizontalPodAutoscaler's pod, return the waiting-requests series."""
    (rule,) = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    _check_adapter_rule(live, rule)
    hpa = yaml.safe_load((K8S / "base" / "serve-hpa.yaml").read_text())
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"] == "vllm_num_requests_waiting"


def _check_adapter_rule(live, rule: dict) -> None:
    """A prometheus-adapter rule's two queries, its template filled in as the adapter would for the
    HorizontalPodAutoscaler's pod: the series is found, and the pod's value is a number."""
    assert live["prom"].series(rule["seriesQuery"]), "the seriesQuery finds no series"
    (series_name,) = metric_names(rule["seriesQuery"])
    matchers = ",".join(f'{k}="{v}"' for k, v in POD_LABELS.items())
    query = (
        rule["metricsQuery"]
        .replace("<<.Series>>", series_name)  # the adapter fills in the series' own name, not the `as` name
        .replace("<<.LabelMatchers>>", matchers)
        .replace("<<.GroupBy>>", "pod")
    )
    (series,) = live["prom"].query(query)
    assert series["metric"] == {"pod": POD_LABELS["pod"]} and _finite([series])


VLLM_DASHBOARD = json.loads((FIXTURES / "vllm-grafana-queries.json").read_text())


@pytest.mark.parametrize("panel", VLLM_DASHBOARD["panels"], ids=lambda p: p["title"])
def test_vllm_dashboard_panels_work_unchanged(live, panel):
    """vLLM's own dashboard, its model picked from its variable's values: every query of the panel returns a
    number for csd-serve."""
    (query,) = VLLM_DASHBOARD["variables"].values()
    assert query == "label_values(model_name)"
    (model,) = live["prom"].label_values("model_name", '{job="csd-serve"}')
    for expr in panel["exprs"]:
        filled = expr.replace("$model_name", model).replace("$__rate_interval", rate_interval(live))
        result = live["prom"].query(filled)
        assert result and _finite(result), f"{panel['title']}: no number for {expr}: {result}"
    if panel["title"] == "Finish Reason":
        reasons = {s["metric"]["finished_reason"] for s in live["prom"].query(filled) if float(s["value"][1])}
        assert reasons and reasons <= {"stop", "length"}, reasons  # the traffic finished; nothing aborted


def test_vllm_autoscaling_rules_work_unchanged(live):
    """KEDA's trigger and the prometheus-adapter rule written for vLLM's queue metric."""
    rules = yaml.safe_load((FIXTURES / "vllm-autoscaling.yaml").read_text())
    (trigger,) = rules["keda"]["triggers"]
    result = live["prom"].query(trigger["metadata"]["query"])
    assert result and _finite(result), result
    assert {s["metric"]["model_name"] for s in result} == set(
        live["prom"].label_values("model_name", "{job=~'.+'}")
    )
    (rule,) = rules["prometheus_adapter"]["rules"]["custom"]
    _check_adapter_rule(live, rule)


def test_dockerfile_healthcheck_passes_against_the_service(live):
    (healthcheck,) = [args for k, args in dockerfile_instructions() if k == "HEALTHCHECK"]
    command = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert command[0] == "python"
    proc = subprocess.run([sys.executable, *command[1:]], env={"CSD_PORT": str(live["port"])}, timeout=30)
    assert proc.returncode == 0


def test_the_endpoint_picker_finds_its_metrics_on_the_running_service(live):
    """What the inference gateway's endpoint picker scrapes from each pool member (the model server protocol,
    tests/deploy/fixtures/model-server-protocol.yaml), on the real service's /metrics, without an API key."""
    protocol = yaml.safe_load((FIXTURES / "model-server-protocol.yaml").read_text())
    families = {f.name: f for f in text_string_to_metric_families(live["metrics"])}
    for metric in protocol["metrics"]:
        family = families[metric["name"]]
        assert family.type == metric["type"], metric
        (sample,) = family.samples  # one series per server: the picker needs no aggregation
        if "range" in metric:
            low, high = metric["range"]
            assert low <= sample.value <= high, sample
        for label in metric.get("labels", []):
            assert label in sample.labels, (metric, sample)
