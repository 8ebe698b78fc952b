"""bench.fleet in its tiny form: R replicas sharing one real Redis against the same replicas alone, on the
embedded model with the trained draft head; the report's shape and its bookkeeping (not its figures)."""

from __future__ import annotations

import json

import pytest

from bench import fleet
from bench.workloads import load_workload


@pytest.mark.usefixtures("single_thread")
def test_fleet_tiny_run_reports_every_setup_and_plots(embedded, tmp_path):
    prompts = [p.token_ids(embedded.tokenizer) for p in load_workload("chat", limit=3)]
    results = fleet.run(embedded, prompts, [2], max_tokens=4, lambda_=0)
    assert [r.label for r in results] == ["1 replica", "2 replicas, shared", "2 replicas, alone"]
    for r in results:
        assert [s.request for s in r.served] == [1, 2, 3]
        assert [s.replica for s in r.served] == [i % r.replicas for i in range(3)]
        assert all(s.target_forwards > 0 and s.completion_tokens <= 4 for s in r.served)
    # The decoding is deterministic and the memory only changes what is rescued: the first request sees
    # an empty memory in every setup, so it decodes the same everywhere.
    assert len({(r.served[0].completion_tokens, r.served[0].target_forwards) for r in results}) == 1
    rep = fleet.report(results, {"requests": 3, "max_tokens": 4, "lambda": 0, "machine": "test"})
    totals = rep["setups"][0]["all"]
    assert totals["target_forwards"] == sum(s.target_forwards for s in results[0].served)
    assert len(rep["setups"][1]["cumulative"]) == 3
    json.dumps(rep)
    fleet.plot(rep, tmp_path / "fleet.png")
    assert (tmp_path / "fleet.png").stat().st_size > 1000
    assert "| 2 replicas, shared |" in fleet.markdown(rep, "python -m bench.fleet --tiny")
