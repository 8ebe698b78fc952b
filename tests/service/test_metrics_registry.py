"""ServiceMetrics in process: vLLM's names, labels and buckets, and what each record_* call moves."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.api.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    ServiceMetrics,
    build_1_2_5_buckets,
)
from service.decoding.types import GenerationRound, RoundStats

LABELS = {"model_name": "m", "engine": "0", "method": "csd", "drafter": "ngram"}


def scrape(metrics: ServiceMetrics) -> list:
    text = generate_latest(metrics.registry).decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: list, name: str, **labels: str) -> float:
    return sum(
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_the_names_vllm_tools_read_are_served_with_vllm_labels():
    m = ServiceMetrics(3, model_name="m", max_batch_size=4)
    m.touch("csd", "ngram", 3)
    names = {s.name for s in scrape(m)}
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:lora_requests_info", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total", "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_decode_time_seconds_bucket", "vllm:request_inference_time_seconds_bucket",
        "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
        "vllm:request_max_num_generation_tokens_bucket",
        "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "csd_spec_decode_num_rescued_tokens_total", "csd_spec_decode_num_recovered_tokens_total",
        "csd_spec_decode_num_bonus_tokens_total", "csd_spec_decode_num_kept_tokens_per_pos_total",
    ):  # fmt: skip
        assert name in names, name
    # one fact, one series: no csd_ copy of a quantity vLLM names
    for old in (
        "csd_num_requests_waiting",
        "csd_generation_tokens_total",
        "csd_spec_decode_num_drafts_total",
    ):
        assert old not in names, old
    samples = scrape(m)
    (waiting,) = [s for s in samples if s.name == "vllm:num_requests_waiting"]
    assert waiting.labels == {"model_name": "m", "engine": "0"}
    reasons = {s.labels["finished_reason"] for s in samples if s.name == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error"}


def test_buckets_are_vllms():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)  # vLLM's docstring example
    assert build_1_2_5_buckets(64) == (1, 2, 5, 10, 20, 50)
    m = ServiceMetrics(3, model_name="m")
    m.touch("csd", "ngram", 3)
    samples = scrape(m)

    def bounds(name: str) -> tuple[float, ...]:
        les = [float(s.labels["le"]) for s in samples if s.name == f"{name}_bucket"]
        return tuple(le for le in les if le != float("inf"))

    assert bounds("vllm:time_to_first_token_seconds") == TTFT_BUCKETS
    assert bounds("vllm:inter_token_latency_seconds") == ITL_BUCKETS
    assert bounds("vllm:request_queue_time_seconds") == REQUEST_LATENCY_BUCKETS
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and REQUEST_LATENCY_BUCKETS[-1] == 7680.0


def test_batch_occupancy_is_the_kv_cache_usage():
    m = ServiceMetrics(3, model_name="m", max_batch_size=4)
    m.set_running(3)
    assert value(scrape(m), "vllm:kv_cache_usage_perc") == 0.75
    assert value(scrape(m), "vllm:num_requests_running") == 3
    m.max_batch_size = 1  # the runtime fell back to one row (a model that cannot be batched)
    m.set_running(1)
    assert value(scrape(m), "vllm:kv_cache_usage_perc") == 1.0


def test_accepted_means_accepted_and_rescues_are_counted_apart():
    m = ServiceMetrics(3, model_name="m")
    decoded = GenerationRound(
        text="abc",
        tokens=[],
        finish_reason=None,
        round=RoundStats(
            num_draft_tokens=3,
            num_accepted=1,
            num_rescued=1,
            num_recovered=1,
            kept_per_position=[True, True, False],
            accepted_per_position=[True, False, False],
        ),
    )
    m.record_decoded_round("csd", "ngram", decoded, since_arrival=0.2, since_last=None)
    m.record_decoded_round("csd", "ngram", decoded, since_arrival=0.3, since_last=0.1)
    s = scrape(m)
    assert value(s, "vllm:spec_decode_num_accepted_tokens_total", **LABELS) == 2
    assert value(s, "csd_spec_decode_num_rescued_tokens_total", **LABELS) == 2
    assert value(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", **LABELS, position="1") == 0
    assert value(s, "csd_spec_decode_num_kept_tokens_per_pos_total", **LABELS, position="1") == 2
    assert value(s, "vllm:spec_decode_num_drafts_total", **LABELS) == 2
    assert value(s, "vllm:time_to_first_token_seconds_count", **LABELS) == 1
    assert value(s, "vllm:inter_token_latency_seconds_count", **LABELS) == 1


def test_a_finished_request_observes_its_phases_an_aborted_one_only_its_reason():
    m = ServiceMetrics(3, model_name="m")
    m.record_finish(
        "csd", "ngram", "length", arrived=10.0, started=10.5, first_token=11.0, now=13.0,
        prompt_tokens=7, generation_tokens=5,
    )  # fmt: skip
    m.record_finish("csd", "ngram", "abort", arrived=10.0, now=12.0)
    s = scrape(m)
    assert value(s, "vllm:request_success_total", **LABELS, finished_reason="length") == 1
    assert value(s, "vllm:request_success_total", **LABELS, finished_reason="abort") == 1
    assert value(s, "vllm:e2e_request_latency_seconds_count", **LABELS) == 1
    assert value(s, "vllm:e2e_request_latency_seconds_sum", **LABELS) == 3.0
    assert value(s, "vllm:request_queue_time_seconds_sum", **LABELS) == 0.5
    assert value(s, "vllm:request_prefill_time_seconds_sum", **LABELS) == 0.5
    assert value(s, "vllm:request_decode_time_seconds_sum", **LABELS) == 2.0
    assert value(s, "vllm:request_inference_time_seconds_sum", **LABELS) == 2.5
    assert value(s, "vllm:request_time_per_output_token_seconds_sum", **LABELS) == 0.5  # 2 s / 4 gaps
    assert value(s, "vllm:request_prompt_tokens_sum", **LABELS) == 7
    assert value(s, "vllm:request_generation_tokens_sum", **LABELS) == 5
    m.record_request_finish("csd", "ngram", 9)
    s = scrape(m)
    assert value(s, "vllm:request_max_num_generation_tokens_count", **LABELS) == 1
    assert value(s, "vllm:request_max_num_generation_tokens_sum", **LABELS) == 9
