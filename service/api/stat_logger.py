"""The engine core's outputs and scheduler stats into Prometheus (vLLM v1's stat loggers, in our terms).

The core reports what happened as data (`service.decoding.requests`); this sink is the only place that turns
it into metric calls, so the core stays free of metrics and the bridge free of their bookkeeping. A readiness
probe (`plan.internal`) counts in no metric.
"""

from __future__ import annotations

import time

from service.api.events import GenerationPlan
from service.api.metrics import ServiceMetrics
from service.decoding.requests import (
    Failed,
    FailReason,
    Finished,
    Output,
    RoundDecoded,
    SchedulerStats,
    Started,
)


class StatLogger:
    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics

    def scheduler(self, stats: SchedulerStats) -> None:
        self.metrics.requests_waiting.set(stats.waiting)
        self.metrics.set_running(stats.running)
        if stats.round_rows:
            self.metrics.batch_rows.observe(stats.round_rows)

    def output(self, plan: GenerationPlan, arrived: float, out: Output) -> None:
        if plan.internal:
            return
        m, method, drafter = self.metrics, plan.method, plan.drafter_label
        if isinstance(out, Started):
            m.record_start(method, drafter, out.prompt_tokens)
        elif isinstance(out, RoundDecoded):
            m.record_decoded_round(method, drafter, out.round, out.timing.now - arrived, out.since_last)
            if out.since_last is None and out.index == 0:  # a request's choices share one prefill
                m.record_prefix_cache(out.stats.prompt_tokens, out.stats.cached_tokens)
        elif isinstance(out, Finished) and out.timing is not None:
            m.record_finish(
                method,
                drafter,
                out.finish_reason,
                arrived=arrived,
                started=out.timing.started,
                first_token=out.timing.first_tokens,
                now=out.timing.now,
                prompt_tokens=len(plan.prompt_ids),
                generation_tokens=out.stats.completion_tokens,
            )
            if out.request_done:
                m.record_request_finish(method, drafter, out.max_generation_tokens)
        elif isinstance(out, Failed):
            if out.reason in (FailReason.ABORTED, FailReason.TIMEOUT):
                self.left(plan, arrived, "abort")
            elif out.was_running:
                self.left(plan, arrived, "error")

    def left(self, plan: GenerationPlan, arrived: float, finished_reason: str) -> None:
        """A request that leaves without finishing (abort, error), for vLLM's request_success counter."""
        if not plan.internal:
            self.metrics.record_finish(
                plan.method, plan.drafter_label, finished_reason, arrived=arrived, now=time.monotonic()
            )
