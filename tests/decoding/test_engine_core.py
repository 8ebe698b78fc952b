"""The engine core schedules on its own: add / abort / step, driven here directly, without asyncio or HTTP.

Real embedded model, real `Engine`, `Batch` and drafters. The outputs are plain data; these tests read them
the way the HTTP bridge does.
"""

from __future__ import annotations

import time

import pytest

from service.decoding import Engine, NgramDrafter, SamplingParams, SpeculativeConfig, run_alone
from service.decoding.engine import EngineCore
from service.decoding.requests import (
    EngineClosed,
    EngineRequest,
    Failed,
    FailReason,
    Finished,
    PromptScored,
    QueueFull,
    RoundDecoded,
    Started,
)
from service.decoding.text import encode_chat

pytestmark = pytest.mark.usefixtures("single_thread")


def _prompt(embedded, text: str) -> list[int]:
    return encode_chat(embedded.tokenizer, [{"role": "user", "content": text}])


def _request(
    embedded, text: str, max_tokens: int = 8, method: str = "sd", ignore_eos: bool = False, **kw
) -> EngineRequest:
    return EngineRequest(
        _prompt(embedded, text),
        SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
        SpeculativeConfig(method=method),
        "ngram",
        **kw,
    )


def _run(core: EngineCore, limit: int = 500) -> list:
    """Step until the core is idle; every output, in order."""
    outputs = []
    for _ in range(limit):
        if core.idle:
            return outputs
        outputs.extend(core.step().outputs)
    raise AssertionError("the core did not finish its work")


@pytest.fixture
def engine(embedded) -> Engine:
    return Engine(embedded, {"ngram": NgramDrafter()})


def test_requests_run_to_the_same_tokens_as_alone(embedded, engine) -> None:
    texts = ["Name three colours.", "Count from one to ten."]
    alone = []
    for text in texts:
        request = _request(embedded, text, max_tokens=12)
        generation = engine.generate(request.prompt_ids, request.sampling, request.spec, "ngram")
        list(run_alone(generation))
        alone.append(generation.text)
    core = EngineCore(engine, max_batch_size=2, max_queue=0)
    core.add("a", _request(embedded, texts[0], max_tokens=12))
    core.add("b", _request(embedded, texts[1], max_tokens=12))
    outputs = _run(core)
    finished = {o.request_id: o for o in outputs if isinstance(o, Finished)}
    assert [finished["a"].text, finished["b"].text] == alone
    assert all(f.request_done and f.timing is not None for f in finished.values())
    started = [o.request_id for o in outputs if isinstance(o, Started)]
    assert sorted(started) == ["a", "b"]
    # the streamed rounds add up to the finished text, per request
    for rid in ("a", "b"):
        assert "".join(
            o.round.text for o in outputs if isinstance(o, RoundDecoded) and o.request_id == rid
        ) == (finished[rid].text)
    assert core.num_running == 0 and core.num_waiting == 0


def test_admission_counts_rows_and_refuses_at_once(embedded, engine) -> None:
    core = EngineCore(engine, max_batch_size=2, max_queue=1)
    core.add("two", _request(embedded, "Hi", n=2))  # 2 rows
    core.add("one", _request(embedded, "Hi"))  # 1 row: full (2 + 1)
    with pytest.raises(QueueFull) as refused:
        core.add("more", _request(embedded, "Hi"))
    assert refused.value.retry_after_s >= 1
    with pytest.raises(QueueFull):
        core.check_room(1)
    core.add("probe", _request(embedded, "Hi", max_tokens=1), priority=True)  # probes skip the bound
    first = core.step()
    # the probe went first (it skipped the line); the 2-row request did not fit beside it and waits
    assert [o.request_id for o in first.outputs if isinstance(o, Started)] == ["probe"]
    assert first.stats.waiting == 2
    _run(core)
    core.check_room(3)  # all done: room again


def test_abort_takes_a_request_out_of_the_queue_and_of_the_batch(embedded, engine) -> None:
    core = EngineCore(engine, max_batch_size=1, max_queue=2)
    core.add("running", _request(embedded, "Write a long story about a cat.", max_tokens=64))
    core.add("queued", _request(embedded, "Hi"))
    core.step()
    core.step()
    assert core.num_running == 1 and core.num_waiting == 1
    core.abort("queued")
    assert core.num_waiting == 0  # off the queue at once: its row is free for admission now
    core.abort("running")
    outputs = core.step().outputs
    failed = {o.request_id: o for o in outputs if isinstance(o, Failed)}
    assert failed["queued"].reason is FailReason.ABORTED and not failed["queued"].was_running
    assert failed["running"].reason is FailReason.ABORTED and failed["running"].was_running
    assert not any(isinstance(o, RoundDecoded) for o in outputs)  # it left before the round
    assert core.idle and core.num_running == 0
    core.abort("never-heard-of")  # ignored
    assert core.idle


def test_a_deadline_drops_a_request_between_rounds(embedded, engine) -> None:
    core = EngineCore(engine, max_batch_size=1, max_queue=1)
    core.add(
        # ignore_eos: it cannot end on its own before the deadline, however fast the machine
        "slow",
        _request(embedded, "Write a long story.", max_tokens=2000, ignore_eos=True),
        deadline=time.monotonic() + 0.5,
    )
    outputs = []
    for _ in range(400):
        outputs.extend(core.step().outputs)
        if core.idle:
            break
    failed = [o for o in outputs if isinstance(o, Failed)]
    assert len(failed) == 1 and failed[0].reason is FailReason.TIMEOUT
    assert not any(isinstance(o, Finished) for o in outputs)


def test_invalid_and_oversized_requests_fail_with_their_reason(embedded, engine) -> None:
    core = EngineCore(engine, max_batch_size=2, max_queue=4)
    bad = EngineRequest(
        _prompt(embedded, "Hi"), SamplingParams(max_tokens=4), SpeculativeConfig(method="sd"), "nope"
    )
    core.add("bad-drafter", bad)
    core.add("too-many", _request(embedded, "Hi", n=3), priority=True)
    core.add("fine", _request(embedded, "Hi", max_tokens=2))
    outputs = _run(core)
    failed = {o.request_id: o.reason for o in outputs if isinstance(o, Failed)}
    assert failed == {"bad-drafter": FailReason.INVALID, "too-many": FailReason.TOO_MANY_ROWS}
    assert [o.request_id for o in outputs if isinstance(o, Finished)] == ["fine"]


def test_n_choices_share_a_request_and_finish_it_together(embedded, engine) -> None:
    core = EngineCore(engine, max_batch_size=3, max_queue=0)
    sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    core.add(
        "n",
        EngineRequest(_prompt(embedded, "Say hi."), sampling, SpeculativeConfig(method="sd"), "ngram", n=3),
    )
    outputs = _run(core)
    finished = [o for o in outputs if isinstance(o, Finished)]
    assert sorted(o.index for o in finished) == [0, 1, 2]
    assert [o.request_done for o in finished] == [False, False, True]
    assert finished[-1].max_generation_tokens == max(o.stats.completion_tokens for o in finished)


def test_scoring_a_prompt_only(embedded, engine) -> None:
    core = EngineCore(engine, max_batch_size=1, max_queue=0)
    request = _request(embedded, "Score me.", prompt_logprobs=2, generate=False, n=2)
    core.add("score", request)
    outputs = _run(core)
    scored = [o for o in outputs if isinstance(o, PromptScored)]
    assert len(scored) == 1 and len(scored[0].logprobs) == len(request.prompt_ids)
    finished = [o for o in outputs if isinstance(o, Finished)]
    assert [(o.index, o.finish_reason, o.text, o.timing) for o in finished] == [
        (0, "length", "", None),
        (1, "length", "", None),
    ]
    assert finished[-1].request_done


def test_close_refuses_new_requests_and_lets_running_ones_finish(embedded, engine) -> None:
    core = EngineCore(engine, max_batch_size=1, max_queue=0)
    core.add("last", _request(embedded, "Hi", max_tokens=3))
    core.close()
    with pytest.raises(EngineClosed):
        core.add("late", _request(embedded, "Hi"))
    assert [o.request_id for o in _run(core) if isinstance(o, Finished)] == ["last"]
