"""The engine worker drives the batch: one failing generation is answered with an error, the others finish.

In-process with the real embedded model, the real `Engine`, `Batch` and `EngineWorker`; the only fake is
the fault itself (a generation whose verification raises), which no real input triggers.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from service.api.events import DoneEvent, ErrorEvent, GenerationPlan, Job
from service.api.metrics import ServiceMetrics
from service.api.worker import EngineWorker
from service.decoding import Engine, NgramDrafter, SamplingParams, SpeculativeConfig, run_alone
from service.decoding.requests import QueueFull
from service.decoding.text import encode_chat

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["Write the days of the week, one per line.", "Name three colours.", "Count from one to ten."]
BROKEN = 1


class FaultyEngine(Engine):
    """A fake fault, named as such: the generation of one prompt fails in its third verification."""

    broken_prompt: list[int] = []

    def generate(self, prompt_ids, *args, **kwargs):
        generation = super().generate(prompt_ids, *args, **kwargs)
        if list(prompt_ids) == self.broken_prompt:
            real, calls = generation._verify, [0]

            def failing(*a, **k):
                calls[0] += 1
                if calls[0] == 3:
                    raise RuntimeError("injected verification fault")
                return real(*a, **k)

            generation._verify = failing
        return generation


def test_a_failing_generation_gets_a_500_and_the_others_their_answers(embedded):
    ids = [encode_chat(embedded.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    engine = FaultyEngine(embedded, {"ngram": NgramDrafter()})
    engine.broken_prompt = ids[BROKEN]
    alone = []
    for prompt in ids:
        g = Engine(embedded, {"ngram": NgramDrafter()}).generate(
            prompt, SamplingParams(max_tokens=16), SpeculativeConfig(method="sd")
        )
        list(run_alone(g))
        alone.append(g.text)

    worker = EngineWorker(engine, ServiceMetrics(6), max_queue=4, max_batch_size=4)
    worker.start()

    async def run_all() -> list:
        loop = asyncio.get_running_loop()
        jobs = []
        for prompt in ids:
            plan = GenerationPlan(
                prompt, SamplingParams(max_tokens=16), SpeculativeConfig(method="sd"), "ngram"
            )
            job = Job(plan, loop, time.monotonic() + 120)
            worker.submit(job)
            jobs.append(job)

        async def last_event(job: Job):
            while True:
                event = await job.next_event()
                if isinstance(event, DoneEvent | ErrorEvent):
                    return event

        return await asyncio.gather(*(last_event(j) for j in jobs))

    try:
        events = asyncio.run(run_all())
    finally:
        worker.stop()
    for i, event in enumerate(events):
        if i == BROKEN:
            assert isinstance(event, ErrorEvent)
            assert event.error.status_code == 500 and event.error.code == "engine_error"
        else:
            assert isinstance(event, DoneEvent), event
            assert event.text == alone[i]
    assert worker.running == 0


class PausingEngine(Engine):
    """A fake delay, named as such: `generate` waits on a gate, holding the worker between taking jobs off the
    queue and putting them into the batch (the window a real burst of requests hits only by chance)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def generate(self, *args, **kwargs):
        self.entered.set()
        self.gate.wait(60)
        return super().generate(*args, **kwargs)


def test_admission_is_exact_while_jobs_are_being_started(embedded):
    """max_batch_size + max_queue requests in the system, never more: jobs being started count too (a burst
    admitted 6 into a server of 2 + 2)."""
    engine = PausingEngine(embedded, {"ngram": NgramDrafter()})
    worker = EngineWorker(engine, ServiceMetrics(6), max_queue=2, max_batch_size=2)
    worker.start()
    loop = asyncio.new_event_loop()
    plan = GenerationPlan(
        encode_chat(embedded.tokenizer, [{"role": "user", "content": "Hi"}]),
        SamplingParams(max_tokens=2),
        SpeculativeConfig(method="vanilla"),
        "ngram",
    )
    try:
        worker.submit(Job(plan, loop, time.monotonic() + 120))
        assert engine.entered.wait(30)  # the worker took the first job off the queue and is starting it
        admitted = 1
        for _ in range(9):
            try:
                worker.submit(Job(plan, loop, time.monotonic() + 120))
                admitted += 1
            except QueueFull:
                pass
        assert admitted == 4
    finally:
        engine.gate.set()
        worker.stop()
        loop.close()
