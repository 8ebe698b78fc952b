"""The tests marked `slow`: the end-to-end half that `make test-fast` (`pytest -m "not slow"`) leaves out.

`make test` and CI run everything; `make test-fast` runs the unit and API tests a developer wants between edits.
A test is slow when it costs more than about 10 s of its own, or starts what a shared fixture does not:
servers with their own settings, a browser, Prometheus, a Redis fleet, a training run, a whole benchmark.
One table, by node id, so the split is read (and re-measured) in one place; tests/conftest.py marks what it
matches. A key is a folder (ends with "/"), a module, a test (all its parameters) or a test with the start of
its parameters (ends with "[" or "-"). The figures: `pytest <folder> --durations=0`, 2026-12-06, a 2-core AMD
EPYC with a benchmark busy on one core (a quiet machine runs them faster); `tests/test_slow_marks.py` checks
that every key still names a test.
"""

from __future__ import annotations

SLOW: dict[str, str] = {
    # ---- a whole folder: end to end by nature (tests/training stays fast: tiny models, 16 s in all)
    "tests/playground/": "a real Chromium against real servers (test_playground.py 71 s)",
    # ---- the service's process-level checks
    "tests/test_cli.py::test_calibrate_then_ocm_top_shows_decoded_patterns": "a calibration run, 24 s",
    "tests/service/test_startup_costs.py": "measures forward costs at start, three server starts: 107 s",
    "tests/service/test_calibration.py": "a calibration over the embedded model: 41 s",
    "tests/service/test_threads.py::test_csd_takes_fewer_threads_beside_a_busy_process_and_warns_when_told_more": (
        "servers beside a busy process: 59 s"
    ),
    "tests/service/test_threads.py::test_the_governor_lowers_threads_when_a_competitor_starts_and_raises_them_when_it_ends": (
        "a competitor process started and stopped: 10 s"
    ),
    "tests/service/test_threads.py::test_csd_logs_its_thread_choice_and_keeps_openmps_wait_where_threads_fit": (
        "server starts: 10 s"
    ),
    # ---- the decoding core: the exhaustive matrices (the lossless, batching and verification tests stay fast)
    "tests/decoding/test_statistics.py": "every method x drafter x way to end, through the engine: 146 s",
    "tests/decoding/test_processing.py": "penalties, bias and logprobs against fresh forwards: 111 s",
    "tests/decoding/test_sampling_distribution.py": "chi-square over 1000 seeded samples per case: 30 s",
    "tests/executor/test_forward_costs.py::test_a_load_burst_does_not_change_the_policy_decisions": (
        "busy processes started beside forwards: 15 s"
    ),
    "tests/executor/test_models.py::test_packed_cpu_weights_give_the_default_kernels_logits": "10 s",
    "tests/decoding/test_suffix_drafter.py::test_strict_sd_with_the_suffix_drafter_is_vanilla_token_for_token": (
        "vanilla and sd over three prompts, twice, per drafter: 25-30 s each"
    ),
    # ---- the API: servers of their own, fuzzing, whole loops (the shared server's tests stay fast)
    "tests/api/test_limits.py": "timeouts, drains and shutdown graces on servers of their own: 49 s",
    "tests/api/test_schemathesis.py": "fuzzes every operation, 25 examples per operation and mode: 46 s",
    "tests/api/test_traffic.py": "record traffic, fine-tune a head, reload it: 31 s",
    "tests/api/test_faults.py": "faulty engines and a dying `csd serve`: 27 s",
    "tests/api/test_cli_serve.py": "`csd serve` processes that fail to start: 19 s",
    "tests/api/test_agents_sdk.py": "the OpenAI Agents SDK against a server of its own: 17 s",
    "tests/api/test_head_reload_ocm.py": "a head trained and reloaded into a server of its own: 13 s",
    "tests/api/test_responses_background.py": "background responses, one running out of time: 13 s",
    "tests/api/test_suffix_fleet.py": "two servers and a redis-server, one stopped under a server: 60-270 s",
    "tests/api/test_tools.py": "tool calling against two servers of its own: 26 s (the parser's tests stay fast)",
    # ---- the benches' end-to-end runs (their arguments and reports stay fast)
    "tests/bench/test_bench_smoke.py": "the main bench end to end: 139 s",
    "tests/bench/test_weight_quality.py::test_a_real_run_scores_int4_against_fp32": "30 s",
    "tests/bench/test_load.py::test_load_bench_end_to_end": "28 s",
    "tests/bench/test_forward.py::test_quick_command_end_to_end": "24 s",
    "tests/bench/test_draft_length.py::test_draft_lengths_are_compared_fixed_and_adaptive": "16 s",
    # ---- the OCM store: Redis fleets and outages (the store's own tests stay fast)
    "tests/ocm_store/test_redis_ha.py": "Sentinel failover and Cluster runs: 27 s",
    "tests/ocm_store/test_redis_outage.py": "Redis killed under a serving server: 11 s",
    # ---- deployment
    "tests/deploy/test_dashboard_live.py": "a real Prometheus scraping a real server: 72 s",
}


def slow_key(nodeid: str) -> str | None:
    """The SLOW key that matches a test's node id, if any."""
    for key in SLOW:
        if key.endswith(("/", "[", "-")):
            if nodeid.startswith(key):
                return key
        elif nodeid == key or nodeid.startswith((key + "::", key + "[")):
            return key
    return None
