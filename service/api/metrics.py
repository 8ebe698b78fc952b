"""Prometheus metrics: one `CollectorRegistry` per app, names following vLLM's spec-decode metrics.

vLLM's `vllm:spec_decode_*` counters become `csd_spec_decode_*` (no colons), so existing queries carry over;
we add what vLLM lacks: rescued, recovered and bonus tokens, time in the rescue path, and the OCM store.
Spec-decode counters move once per decoding round (not once per request), so a dashboard follows a long
generation as it happens.

Definitions (the same words as the API and the docs):
- acceptance rate = accepted / draft tokens (vLLM's: a rescued token is not accepted); kept rate =
  (accepted + rescued) / draft tokens; rescue rate = rescued / draft tokens;
- `..._num_accepted_tokens_per_pos_total{position=i}` counts rounds whose draft token at position i was
  accepted (vLLM's), `..._num_kept_tokens_per_pos_total{position=i}` those where it was kept (accepted or
  rescued); divide by `..._num_drafts_total` for the survival rate of position i;
- tokens per target forward (vLLM's mean acceptance length) = generation tokens / target forwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from ocm_store.base import StoreStatus
from service.decoding.types import RoundStats

log = logging.getLogger(__name__)

SPEC_LABELS = ("method", "drafter")

# vLLM's buckets: time to first token, inter-token latency, end-to-end latency (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class ServiceMetrics:
    """All metrics of one app. Thread-safe (prometheus-client is): the engine worker updates them."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def counter(name: str, doc: str, labels: Iterable[str] = SPEC_LABELS) -> Counter:
            return Counter(name, doc, list(labels), registry=r)

        self.num_drafts = counter(
            "csd_spec_decode_num_drafts", "Decoding rounds that verified at least one draft token."
        )
        self.num_draft_tokens = counter("csd_spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter(
            "csd_spec_decode_num_accepted_tokens", "Draft tokens accepted (equal to the target's choice)."
        )
        self.num_accepted_tokens_per_pos = counter(
            "csd_spec_decode_num_accepted_tokens_per_pos",
            "Rounds whose draft token at this position was accepted (equal to the target's choice).",
            (*SPEC_LABELS, "position"),
        )
        self.num_kept_tokens_per_pos = counter(
            "csd_spec_decode_num_kept_tokens_per_pos",
            "Rounds whose draft token at this position was kept (accepted or rescued).",
            (*SPEC_LABELS, "position"),
        )
        self.num_rescued_tokens = counter(
            "csd_spec_decode_num_rescued_tokens", "Draft tokens rescued by the OCM and semantic gates (CSD)."
        )
        self.num_recovered_tokens = counter(
            "csd_spec_decode_num_recovered_tokens", "Target tokens emitted after a rejected draft token."
        )
        self.num_bonus_tokens = counter(
            "csd_spec_decode_num_bonus_tokens", "Free target tokens after a fully kept draft."
        )
        self.target_forwards = counter("csd_target_forwards", "Target model forward passes (rounds).")
        self.prompt_tokens = counter("csd_prompt_tokens", "Prompt tokens of started generations.")
        self.generation_tokens = counter("csd_generation_tokens", "Tokens generated (emitted to clients).")
        self.ocm_seconds = counter(
            "csd_ocm_seconds", "Seconds spent in the Online Correction Memory (the rescue path)."
        )
        self.ttft = Histogram(
            "csd_time_to_first_token_seconds",
            "From request arrival to the first decoding round's tokens.",
            SPEC_LABELS,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "csd_inter_token_latency_seconds",
            "Time between consecutive decoding rounds of a request (a round may emit several tokens).",
            SPEC_LABELS,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "csd_e2e_request_latency_seconds",
            "From request arrival to the end of its generation (finished requests).",
            SPEC_LABELS,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.tokens_per_forward = Histogram(
            "csd_tokens_per_target_forward",
            "Tokens one target forward produced: kept draft tokens + 1 (recovered, bonus or plain).",
            SPEC_LABELS,
            buckets=tuple(float(i) for i in range(1, num_speculative_tokens + 2)),
            registry=r,
        )
        self.batch_rows = Histogram(
            "csd_batch_rows",
            "Generations that shared one decoding forward (continuous batching); the count is the number of "
            "batched forwards.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024),
            registry=r,
        )
        self.requests_running = Gauge(
            "csd_num_requests_running", "Generations running on the engine.", registry=r
        )
        self.requests_waiting = Gauge(
            "csd_num_requests_waiting", "Generations waiting for the engine.", registry=r
        )
        self.requests = Counter(
            "csd_requests",
            "HTTP responses by endpoint and status code.",
            ["endpoint", "status_code"],
            registry=r,
        )

    def touch(self, method: str, drafter: str, num_speculative_tokens: int) -> None:
        """Create the series of a (method, drafter) pair at 0, so dashboards show it before traffic."""
        for metric in (
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.num_rescued_tokens,
            self.num_recovered_tokens, self.num_bonus_tokens, self.target_forwards, self.prompt_tokens,
            self.generation_tokens, self.ocm_seconds, self.ttft, self.itl, self.e2e, self.tokens_per_forward,
        ):  # fmt: skip
            metric.labels(method, drafter)
        for position in range(num_speculative_tokens):
            self.num_accepted_tokens_per_pos.labels(method, drafter, str(position))
            self.num_kept_tokens_per_pos.labels(method, drafter, str(position))

    def record_round(self, method: str, drafter: str, r: RoundStats) -> None:
        """One target forward's worth of speculation statistics."""
        labels = (method, drafter)
        self.target_forwards.labels(*labels).inc()
        # Every forward yields its kept draft tokens plus exactly one target token (recovered, bonus or plain).
        self.tokens_per_forward.labels(*labels).observe(r.num_kept + 1)
        if r.num_draft_tokens:
            self.num_drafts.labels(*labels).inc()
            self.num_draft_tokens.labels(*labels).inc(r.num_draft_tokens)
        if r.num_accepted:
            self.num_accepted_tokens.labels(*labels).inc(r.num_accepted)
        if r.num_rescued:
            self.num_rescued_tokens.labels(*labels).inc(r.num_rescued)
        if r.num_recovered:
            self.num_recovered_tokens.labels(*labels).inc(r.num_recovered)
        if r.num_bonus:
            self.num_bonus_tokens.labels(*labels).inc(r.num_bonus)
        if r.ocm_seconds:
            self.ocm_seconds.labels(*labels).inc(r.ocm_seconds)
        for position, accepted in enumerate(r.accepted_per_position):
            if accepted:
                self.num_accepted_tokens_per_pos.labels(*labels, str(position)).inc()
        for position, kept in enumerate(r.kept_per_position):
            if kept:
                self.num_kept_tokens_per_pos.labels(*labels, str(position)).inc()


class OCMStoreCollector(Collector):
    """Exports the OCM store's state at scrape time from `store.status()`.

    `status_fn` returns None while the store is not open yet (models still loading): nothing is exported
    then. A failing status call is logged and reported as unhealthy rather than failing the scrape.
    """

    # Keys of StoreStatus.extra; a backend that lacks one reports 0.
    BUFFERED = "buffered_increments"
    DROPPED = "dropped_increments"
    EVICTED = ("evicted_patterns", "evicted")  # the in-process store says "evicted"
    RECONNECTS = "reconnects"
    FLUSH_SECONDS = "flush_seconds_total"
    FLUSHES = "flushes"

    def __init__(self, status_fn: Callable[[], StoreStatus | None]) -> None:
        self.status_fn = status_fn

    def describe(self) -> list[Metric]:
        return []  # collected lazily: the store may not exist when the registry is built

    def collect(self) -> Iterable[Metric]:
        try:
            status = self.status_fn()
        except Exception as exc:  # a scrape must never fail because the store does
            log.warning("OCM store status failed during a scrape: %s", exc)
            status = StoreStatus(backend="unknown", healthy=False, patterns=0, detail=str(exc))
        if status is None:
            return
        extra = status.extra or {}

        def number(*keys: str) -> float:
            for key in keys:
                value = extra.get(key)
                if isinstance(value, int | float):
                    return float(value)
            return 0.0

        healthy = GaugeMetricFamily(
            "csd_ocm_store_healthy",
            "1 when the OCM store works normally, 0 when degraded.",
            labels=["backend"],
        )
        healthy.add_metric([status.backend], 1.0 if status.healthy else 0.0)
        yield healthy
        yield GaugeMetricFamily(
            "csd_ocm_patterns", "Distinct divergence patterns in the OCM store.", value=status.patterns
        )
        yield GaugeMetricFamily(
            "csd_ocm_buffered_increments",
            "Pattern increments buffered locally, not yet written to the shared store.",
            value=number(self.BUFFERED),
        )
        yield CounterMetricFamily(
            "csd_ocm_dropped_increments",
            "Pattern increments dropped (buffer full while the shared store was unreachable).",
            value=number(self.DROPPED),
        )
        yield CounterMetricFamily(
            "csd_ocm_evicted_patterns", "Rare patterns evicted to bound memory.", value=number(*self.EVICTED)
        )
        yield CounterMetricFamily(
            "csd_ocm_reconnects", "Reconnections to the shared store.", value=number(self.RECONNECTS)
        )
        yield SummaryMetricFamily(
            "csd_ocm_flush_seconds",
            "Time spent flushing buffered increments to the shared store.",
            count_value=number(self.FLUSHES),
            sum_value=number(self.FLUSH_SECONDS),
        )
