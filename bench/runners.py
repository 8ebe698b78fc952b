"""One runner per thing we time: our engine with a method, and transformers' own `generate` (the peer).

Every runner takes the same prompt token ids and token budget and returns a `RunOutput`; its wall time covers
the whole call (prefill, drafting, verification, detokenisation), never the prompt's tokenisation.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from service.decoding import Engine, LoadedModel, Method, SamplingParams, SpeculativeConfig, run_alone


@dataclass(frozen=True)
class MethodSpec:
    """One column of the benchmark: what runs, with which drafter and which OCM.

    Labels: "vanilla", "sd", "lossy", "csd-cold", "csd", "hf-greedy", "hf-pld"; the `-adaptive` variants; with a
    draft model "sd-model", "lossy-model", "csd-model-cold", "csd-model", "csd-model-unguarded", "hf-assisted";
    with a draft head "sd-head", "csd-head", "csd-head-unguarded", "sd-combined", "csd-combined" and their
    `-adaptive` variants.
    """

    label: str
    runner: str  # "engine" or "hf"
    method: Method | None = None  # engine only
    drafter: str | None = None  # "ngram", "head", "combined" or "model"
    # which engine runs it: None (no OCM), "cold" (OCM empty at the start of each workload), "calibrated";
    # the "-adaptive" variants add the service's default cost-aware draft policy (service/decoding/draft_policy.py)
    ocm: str | None = None
    hf_mode: str | None = None  # hf only: "greedy", "prompt_lookup" or "assisted"
    # CSD's rescue guards (service/decoding/fact_guard.py, verification.turn_guard); both off only in the
    # "-unguarded" column that measures what they block and what they cost (the paper's CSD)
    guard_facts: bool = True
    guard_turns: bool = True
    # runs on a float32 copy of the target instead (only "vanilla-fp32", beside a target served in another
    # dtype): the reference that speedups are also quoted against, and the serving dtype's quality check
    fp32_target: bool = False

    @property
    def lossless(self) -> bool:
        """Outputs must equal vanilla greedy token for token (checked for our sd, shown for the peer)."""
        if self.fp32_target:  # another dtype rounds differently: compared, never required to be equal
            return False
        return self.method in (Method.VANILLA, Method.SD) or self.runner == "hf"

    @property
    def is_ours(self) -> bool:
        return self.runner == "engine"


VANILLA = MethodSpec("vanilla", "engine", Method.VANILLA)
VANILLA_FP32 = MethodSpec("vanilla-fp32", "engine", Method.VANILLA, fp32_target=True)
CSD_COLD = MethodSpec("csd-cold", "engine", Method.CSD, "ngram", ocm="cold")
CSD = MethodSpec("csd", "engine", Method.CSD, "ngram", ocm="calibrated")


def method_specs(
    with_draft_model: bool, with_peer: bool = True, with_head: bool = False, with_fp32: bool = False
) -> list[MethodSpec]:
    """`with_fp32`: the target is served in another dtype than float32; add `vanilla-fp32`."""
    specs = [
        VANILLA,
        *([VANILLA_FP32] if with_fp32 else []),
        MethodSpec("sd", "engine", Method.SD, "ngram"),
        MethodSpec("lossy", "engine", Method.LOSSY, "ngram"),
        CSD_COLD,
        CSD,
        # as `csd serve` runs by default: drafts verified only as far as they pay (measured forward costs)
        MethodSpec("sd-adaptive", "engine", Method.SD, "ngram", ocm="adaptive"),
        MethodSpec("csd-adaptive", "engine", Method.CSD, "ngram", ocm="calibrated-adaptive"),
    ]
    if with_peer:
        specs += [
            MethodSpec("hf-greedy", "hf", hf_mode="greedy"),
            MethodSpec("hf-pld", "hf", hf_mode="prompt_lookup"),
        ]
    if with_head:
        specs += [
            MethodSpec("sd-head", "engine", Method.SD, "head"),
            MethodSpec("csd-head", "engine", Method.CSD, "head", ocm="calibrated"),
            # the same without the guards (the paper's CSD): what the guards block and what they cost
            MethodSpec(
                "csd-head-unguarded",
                "engine",
                Method.CSD,
                "head",
                ocm="calibrated",
                guard_facts=False,
                guard_turns=False,
            ),
            MethodSpec("sd-combined", "engine", Method.SD, "combined"),
            MethodSpec("csd-combined", "engine", Method.CSD, "combined", ocm="calibrated"),
            # what `csd serve` runs by default once the embedded head exists (drafter "combined", adaptive)
            MethodSpec("sd-combined-adaptive", "engine", Method.SD, "combined", ocm="adaptive"),
            MethodSpec("csd-combined-adaptive", "engine", Method.CSD, "combined", ocm="calibrated-adaptive"),
        ]
    if with_draft_model:
        specs += [
            MethodSpec("sd-model", "engine", Method.SD, "model"),
            MethodSpec("lossy-model", "engine", Method.LOSSY, "model"),
            MethodSpec("csd-model-cold", "engine", Method.CSD, "model", ocm="cold"),
            MethodSpec("csd-model", "engine", Method.CSD, "model", ocm="calibrated"),
            # the paper's CSD on the paper's setting: what the guards block on a draft model's divergences
            MethodSpec(
                "csd-model-unguarded",
                "engine",
                Method.CSD,
                "model",
                ocm="calibrated",
                guard_facts=False,
                guard_turns=False,
            ),
        ]
        if with_peer:
            specs.append(MethodSpec("hf-assisted", "hf", hf_mode="assisted"))
    return specs


def select_specs(specs: list[MethodSpec], methods: Sequence[str], peer: bool) -> list[MethodSpec]:
    """The columns `--methods` names, and the peer's beside them unless `--no-peer` (`peer` False), and the
    fp32 reference where there is one: a comparison must not lose its reference silently."""
    return [s for s in specs if s.label in methods or (s.runner == "hf" and peer) or s.fp32_target]


@dataclass
class RunOutput:
    token_ids: list[int]
    text: str
    seconds: float  # wall time of the whole call
    target_forwards: int
    # speculation counters; None where the runner cannot see them (the peer)
    draft_tokens: int | None = None
    accepted: int | None = None
    rescued: int | None = None
    recovered: int | None = (
        None  # rounds that ended in a rejection (the target's token replaced a draft token)
    )
    ocm_seconds: float = 0.0
    decode_seconds: float = 0.0  # our engine: time in decoding rounds (the OCM share's denominator)
    # kept draft tokens (accepted + rescued) in a round that carried a draft -> rounds (acceptance lengths)
    kept_per_round: Counter = field(default_factory=Counter)
    undrafted_rounds: int = 0  # rounds where the drafter had nothing to propose
    # rescued tokens as (draft token, the target token it replaced)
    rescues: list[tuple[int, int]] = field(default_factory=list)
    # (tokens emitted so far, seconds since the call began) after each target forward; empty for the peer,
    # whose `generate` does not show its rounds
    token_times: list[tuple[int, float]] = field(default_factory=list)
    # rescues the guards refused that both CSD gates had passed, by reason ("turn", "fact", "number", ...)
    refused_rescues: Counter = field(default_factory=Counter)

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    def seconds_to(self, n: int) -> float:
        """Wall time until the first `n` tokens were out: the round that emitted the n-th token (our engine);
        pro rata of the whole call for the peer (an approximation, its prefill spread over its tokens)."""
        if n >= self.tokens or n <= 0:
            return self.seconds if n > 0 else 0.0
        for emitted, seconds in self.token_times:
            if emitted >= n:
                return seconds
        return self.seconds * n / self.tokens


def run_engine(
    engine: Engine, spec: MethodSpec, prompt_ids: list[int], max_tokens: int, config: SpeculativeConfig
) -> RunOutput:
    """config carries num_speculative_tokens, lambda, tau and the lossy threshold; the method comes from spec."""
    assert spec.method is not None
    speculative = SpeculativeConfig(
        method=spec.method,
        num_speculative_tokens=config.num_speculative_tokens,
        lambda_=config.lambda_,
        tau=config.tau,
        lossy_threshold=config.lossy_threshold,
        guard_facts=config.guard_facts and spec.guard_facts,
        guard_turns=config.guard_turns and spec.guard_turns,
    )
    kept: Counter = Counter()
    undrafted = 0
    token_times: list[tuple[int, float]] = []
    emitted = 0
    started = time.perf_counter()
    generation = engine.generate(
        prompt_ids, SamplingParams(max_tokens=max_tokens), speculative, drafter=spec.drafter or "ngram"
    )
    for decoded in run_alone(generation):
        emitted += len(decoded.tokens)
        token_times.append((emitted, time.perf_counter() - started))
        if decoded.round.num_draft_tokens:
            kept[decoded.round.num_kept] += 1
        else:
            undrafted += 1
    seconds = time.perf_counter() - started
    stats = generation.stats
    return RunOutput(
        token_ids=[t.token_id for t in generation.tokens],
        text=generation.text,
        seconds=seconds,
        target_forwards=stats.target_forwards,
        draft_tokens=stats.num_draft_tokens,
        accepted=stats.num_accepted,
        rescued=stats.num_rescued,
        recovered=stats.num_recovered if speculative.speculates else None,
        ocm_seconds=stats.ocm_seconds,
        decode_seconds=stats.decode_seconds,
        kept_per_round=kept,
        undrafted_rounds=undrafted,
        rescues=[
            (t.token_id, t.replaced_token_id) for t in generation.tokens if t.replaced_token_id is not None
        ],
        token_times=token_times,
        refused_rescues=Counter(generation.refused_rescues),
    )


class ForwardCounter:
    """Counts forward calls of a module (the peer's target forwards) while installed."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.calls = 0
        self._handle = None

    def __enter__(self) -> ForwardCounter:
        self.calls = 0
        self._handle = self.module.register_forward_pre_hook(self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._handle is not None
        self._handle.remove()

    def _count(self, *args: object) -> None:
        self.calls += 1


def run_hf(
    target: LoadedModel,
    spec: MethodSpec,
    prompt_ids: list[int],
    max_tokens: int,
    num_speculative_tokens: int,
    draft: LoadedModel | None = None,
) -> RunOutput:
    """transformers' `generate` on the same model object, greedy, stopping at the same EOS tokens as ours."""
    eos = sorted(target.eos_token_ids())
    kwargs: dict = {}
    if spec.hf_mode == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = num_speculative_tokens
    elif spec.hf_mode == "assisted":
        if draft is None:
            raise ValueError("hf-assisted needs a draft model")
        kwargs["assistant_model"] = draft.model
        kwargs["num_assistant_tokens"] = num_speculative_tokens
    input_ids = torch.tensor([prompt_ids], device=target.device)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else eos[0]
    with ForwardCounter(target.model) as counter, torch.inference_mode():
        started = time.perf_counter()
        out = target.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=eos,
            pad_token_id=pad,
            **kwargs,
        )
        new = out[0, len(prompt_ids) :].tolist()
        # generate keeps the EOS token it stopped on; our engine does not emit it: drop it for parity.
        for i, token in enumerate(new):
            if token in eos:
                new = new[:i]
                break
        text = target.tokenizer.decode(new, skip_special_tokens=True)
        seconds = time.perf_counter() - started
    return RunOutput(token_ids=new, text=text, seconds=seconds, target_forwards=counter.calls)
