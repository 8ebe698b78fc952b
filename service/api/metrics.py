"""Prometheus metrics: one `CollectorRegistry` per app, under vLLM's names so that vLLM's tools work unchanged.

Operators already run tooling written for vLLM: its Grafana dashboard, HPA/KEDA rules on
`vllm:num_requests_waiting`, and the Gateway API Inference Extension's endpoint picker, which routes on
`vllm:num_requests_waiting`, `vllm:num_requests_running` and `vllm:kv_cache_usage_perc`. So every quantity
vLLM also measures is exported under vLLM's name (`vllm:` prefix, names from vLLM v1's
`vllm/v1/metrics/loggers.py`), with vLLM's labels `model_name` and `engine` (always "0": one engine per
process) and vLLM's buckets. There is no `csd_` copy of those: one fact, one series. What vLLM lacks keeps a
`csd_` name: rescued, recovered and bonus tokens, kept tokens per position, target forwards, tokens per target
forward, batch rows, time in the rescue path, HTTP responses and the OCM store. Every series carries
`model_name`; those of a generation also `method` and `drafter` (they vary per request).

Spec-decode counters move once per decoding round (not once per request), so a dashboard follows a long
generation as it happens.

Definitions (the same words as the API and the docs):
- accepted = the draft token equals the target's choice, as in vLLM; a rescued token is not accepted.
  Acceptance rate (vLLM's) = accepted / draft tokens; kept rate = (accepted + rescued) / draft tokens;
  rescue rate = rescued / draft tokens;
- vLLM's mean acceptance length = 1 + accepted / drafts; with rescues: 1 + (accepted + rescued) / drafts;
- `vllm:spec_decode_num_accepted_tokens_per_pos_total{position=i}` counts rounds whose draft token at
  position i was accepted, `csd_spec_decode_num_kept_tokens_per_pos_total{position=i}` those where it was kept
  (accepted or rescued); divide by `vllm:spec_decode_num_drafts_total` for the survival rate of position i;
- tokens per target forward = generation tokens / target forwards;
- `vllm:kv_cache_usage_perc`: csd-serve has no paged KV pool whose blocks could be counted. Its caches grow
  per sequence, and what runs out first is the batch: a request beyond `max_batch_size` rows waits. So this
  gauge is the fraction of batch rows in use (generations in the batch / max_batch_size), 1.0 when a new
  request would queue: the saturation signal the endpoint picker reads it for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from ocm_store.base import StoreStatus
from service.decoding.types import GenerationRound, RoundStats

log = logging.getLogger(__name__)

ENGINE = "0"  # vLLM labels each engine core (data parallelism); a csd-serve process has one
BASE_LABELS = ("model_name", "engine")
SPEC_LABELS = (*BASE_LABELS, "method", "drafter")
# vLLM's FinishReason values (its `str()`), plus "error" for a generation the engine failed.
FINISHED_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets: time to first token, inter-token latency, request latencies (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# Prompt lengths up to this many tokens get their own bucket (vLLM bounds them by max_model_len).
MAX_PROMPT_TOKENS_BUCKET = 131072


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(float(mantissa * scale))
        scale *= 10


class ServiceMetrics:
    """All metrics of one app. Thread-safe (prometheus-client is): the engine worker updates them."""

    def __init__(
        self,
        num_speculative_tokens: int,
        model_name: str = "unknown",
        max_batch_size: int = 1,
        max_tokens: int = 2048,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        r = self.registry
        base = (model_name, ENGINE)
        self.base_labels = base

        def counter(name: str, doc: str, labels: Iterable[str] = SPEC_LABELS) -> Counter:
            return Counter(name, doc, list(labels), registry=r)

        def histogram(name: str, doc: str, buckets: Iterable[float], labels=SPEC_LABELS) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=tuple(buckets), registry=r)

        # ---- vLLM's names
        self.num_drafts = counter(
            "vllm:spec_decode_num_drafts", "Decoding rounds that verified at least one draft token."
        )
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Draft tokens accepted (equal to the target's choice; rescued tokens are not counted).",
        )
        self.num_accepted_tokens_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Rounds whose draft token at this position was accepted (equal to the target's choice).",
            (*SPEC_LABELS, "position"),
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of started generations.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated (emitted to clients).")
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", list(BASE_LABELS),
            registry=r,
        )  # fmt: skip
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache (not prefilled).",
            list(BASE_LABELS), registry=r,
        )  # fmt: skip
        for family in (self.prefix_cache_queries, self.prefix_cache_hits):
            family.labels(*base)  # published at 0 from the start, as vLLM does
        self.request_success = counter(
            "vllm:request_success",
            "Finished requests by finish reason (stop, length; abort: cancelled, timed out or client gone; "
            "error: failed in the engine).",
            (*SPEC_LABELS, "finished_reason"),
        )
        self.num_preemptions = Counter(
            "vllm:num_preemptions",
            "Preempted requests. Always 0: a generation keeps its batch row until it finishes.",
            list(BASE_LABELS),
            registry=r,
        ).labels(*base)
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "From request arrival to the first decoding round's tokens.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive decoding rounds of a request (a round may emit several tokens, as in "
            "vLLM with speculative decoding).",
            ITL_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Per finished request: decode time / (generated tokens - 1).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "From request arrival to the end of its generation (finished requests).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "From request arrival until its generation joined the batch (finished requests).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "From joining the batch to the end of the generation (finished requests).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "From joining the batch to the first decoding round's tokens (prompt prefill; finished requests).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "From the first decoding round's tokens to the end of the generation (finished requests).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per finished request.",
            build_1_2_5_buckets(MAX_PROMPT_TOKENS_BUCKET),
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per finished request.",
            build_1_2_5_buckets(max(max_tokens, 1)),
        )
        self.request_max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Generated tokens of a finished request's longest choice (its largest of n sequences).",
            build_1_2_5_buckets(max(max_tokens, 1)),
        )
        self.requests_running = Gauge(
            "vllm:num_requests_running", "Generations in the batch (running).", list(BASE_LABELS), registry=r
        ).labels(*base)
        self.requests_waiting = Gauge(
            "vllm:num_requests_waiting",
            "Requests waiting for batch rows (one per choice).",
            list(BASE_LABELS),
            registry=r,
        ).labels(*base)
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of batch rows in use (generations in the batch / max_batch_size; 1 = a new request "
            "queues). csd-serve has no paged KV pool: its batch rows are the capacity that runs out.",
            list(BASE_LABELS),
            registry=r,
        ).labels(*base)
        self.kv_cache_usage.set(0.0)
        # The endpoint picker's LoRA-affinity scorer reads this; csd-serve serves no adapters, and says so.
        Gauge(
            "vllm:lora_requests_info",
            "LoRA adapters: none are served (max_lora 0); the value is when this was last updated.",
            ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        ).labels(model_name, "0", "", "").set(time.time())

        # ---- what vLLM lacks
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
        self.ocm_seconds = counter(
            "csd_ocm_seconds", "Seconds spent in the Online Correction Memory (the rescue path)."
        )
        self.tokens_per_forward = histogram(
            "csd_tokens_per_target_forward",
            "Tokens one target forward decided: the round's emitted tokens and the end-of-sequence it ended on.",
            (float(i) for i in range(1, num_speculative_tokens + 2)),
        )
        self.batch_rows = Histogram(
            "csd_batch_rows",
            "Generations that shared one decoding forward (continuous batching); the count is the number of "
            "batched forwards.",
            ["model_name"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024),
            registry=r,
        ).labels(model_name)
        self.requests = Counter(
            "csd_requests",
            "HTTP responses by endpoint and status code (API traffic: probes and scrapes are not counted).",
            ["model_name", "endpoint", "status_code"],
            registry=r,
        )

    def touch(self, method: str, drafter: str, num_speculative_tokens: int) -> None:
        """Create the series of a (method, drafter) pair at 0, so dashboards show it before traffic."""
        labels = (*self.base_labels, method, drafter)
        for metric in (
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.num_rescued_tokens,
            self.num_recovered_tokens, self.num_bonus_tokens, self.target_forwards, self.prompt_tokens,
            self.generation_tokens, self.ocm_seconds, self.ttft, self.itl, self.tpot, self.e2e,
            self.queue_time, self.inference_time, self.prefill_time, self.decode_time,
            self.request_prompt_tokens, self.request_generation_tokens, self.request_max_generation_tokens,
            self.tokens_per_forward,
        ):  # fmt: skip
            metric.labels(*labels)
        for reason in FINISHED_REASONS:
            self.request_success.labels(*labels, reason)
        for position in range(num_speculative_tokens):
            self.num_accepted_tokens_per_pos.labels(*labels, str(position))
            self.num_kept_tokens_per_pos.labels(*labels, str(position))

    # ------------------------------------------------------------ what the engine worker reports

    def set_running(self, running: int) -> None:
        """Generations in the batch, and the batch's occupancy (the `kv_cache_usage_perc` analogue)."""
        self.requests_running.set(running)
        self.kv_cache_usage.set(min(1.0, running / self.max_batch_size))

    def record_start(self, method: str, drafter: str, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(*self.base_labels, method, drafter).inc(prompt_tokens)

    def record_prefix_cache(self, queried: int, hit: int) -> None:
        """A request's prompt lookup in the prefix cache, in tokens."""
        self.prefix_cache_queries.labels(*self.base_labels).inc(queried)
        self.prefix_cache_hits.labels(*self.base_labels).inc(hit)

    def record_decoded_round(
        self,
        method: str,
        drafter: str,
        decoded: GenerationRound,
        since_arrival: float,
        since_last: float | None,
    ) -> None:
        """One decoding round of one request: its speculation statistics, tokens and latency."""
        labels = (*self.base_labels, method, drafter)
        self.record_round(method, drafter, decoded.round)
        if decoded.tokens:
            self.generation_tokens.labels(*labels).inc(len(decoded.tokens))
        if since_last is None:
            self.ttft.labels(*labels).observe(since_arrival)
        else:
            self.itl.labels(*labels).observe(since_last)

    def record_finish(
        self,
        method: str,
        drafter: str,
        finished_reason: str,
        *,
        arrived: float,
        started: float | None = None,
        first_token: float | None = None,
        now: float,
        prompt_tokens: int = 0,
        generation_tokens: int = 0,
    ) -> None:
        """A request left: counted by finish reason. A generation that finished (stop, length) also
        observes vLLM's per-request histograms, from its monotonic timestamps: arrival, joining the batch,
        first tokens and now."""
        labels = (*self.base_labels, method, drafter)
        self.request_success.labels(*labels, finished_reason).inc()
        if finished_reason not in ("stop", "length") or started is None or first_token is None:
            return
        self.e2e.labels(*labels).observe(now - arrived)
        self.queue_time.labels(*labels).observe(started - arrived)
        self.inference_time.labels(*labels).observe(now - started)
        self.prefill_time.labels(*labels).observe(first_token - started)
        self.decode_time.labels(*labels).observe(now - first_token)
        self.request_prompt_tokens.labels(*labels).observe(prompt_tokens)
        self.request_generation_tokens.labels(*labels).observe(generation_tokens)
        if generation_tokens > 1:
            self.tpot.labels(*labels).observe((now - first_token) / (generation_tokens - 1))

    def record_request_finish(self, method: str, drafter: str, max_generation_tokens: int) -> None:
        """Every choice of a request finished: vLLM's per-request (not per-sequence) histogram."""
        labels = (*self.base_labels, method, drafter)
        self.request_max_generation_tokens.labels(*labels).observe(max_generation_tokens)

    def record_round(self, method: str, drafter: str, r: RoundStats) -> None:
        """One target forward's worth of speculation statistics."""
        labels = (*self.base_labels, method, drafter)
        self.target_forwards.labels(*labels).inc()
        # what the round decided (its emitted tokens and the end-of-sequence it ended on): a round cut by a
        # stop string counts what it emitted, as GenerationStats.tokens_per_forward does
        self.tokens_per_forward.labels(*labels).observe(r.tokens_decided)
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
    RESTORES = "restores"
    RESTORED = "restored_increments"
    FLUSH_SECONDS = "flush_seconds_total"
    FLUSHES = "flushes"

    def __init__(self, status_fn: Callable[[], StoreStatus | None], model_name: str = "unknown") -> None:
        self.status_fn = status_fn
        self.model_name = model_name

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

        m = [self.model_name]

        def family(kind, name: str, doc: str, value: float) -> Metric:
            metric = kind(name, doc, labels=["model_name"])
            metric.add_metric(m, value)
            return metric

        healthy = GaugeMetricFamily(
            "csd_ocm_store_healthy",
            "1 when the OCM store works normally, 0 when degraded.",
            labels=["model_name", "backend"],
        )
        healthy.add_metric([*m, status.backend], 1.0 if status.healthy else 0.0)
        yield healthy
        yield family(
            GaugeMetricFamily,
            "csd_ocm_patterns",
            "Distinct divergence patterns in the OCM store.",
            status.patterns,
        )
        yield family(
            GaugeMetricFamily,
            "csd_ocm_buffered_increments",
            "Pattern increments buffered locally, not yet written to the shared store.",
            number(self.BUFFERED),
        )
        yield family(
            CounterMetricFamily,
            "csd_ocm_dropped_increments",
            "Pattern increments dropped (buffer full while the shared store was unreachable).",
            number(self.DROPPED),
        )
        yield family(
            CounterMetricFamily,
            "csd_ocm_evicted_patterns",
            "Rare patterns evicted to bound memory.",
            number(*self.EVICTED),
        )
        yield family(
            CounterMetricFamily,
            "csd_ocm_reconnects",
            "Reconnections to the shared store.",
            number(self.RECONNECTS),
        )
        yield family(
            CounterMetricFamily,
            "csd_ocm_restores",
            "Times this replica restored counts the shared store had lost (a Redis that came back empty).",
            number(self.RESTORES),
        )
        yield family(
            CounterMetricFamily,
            "csd_ocm_restored_increments",
            "Pattern increments this replica wrote back to the shared store after a data loss.",
            number(self.RESTORED),
        )
        flush = SummaryMetricFamily(
            "csd_ocm_flush_seconds",
            "Time spent flushing buffered increments to the shared store.",
            labels=["model_name"],
        )
        flush.add_metric(m, count_value=number(self.FLUSHES), sum_value=number(self.FLUSH_SECONDS))
        yield flush
