"""The state one benchmark run shares: models, drafters, the calibrated OCM, quality scorers, progress bar."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from bench.calibration import copy_store, engine_with_store
from bench.config import BenchConfig
from bench.metrics import LogLikelihoodScorer, SentenceEmbedder
from bench.runners import MethodSpec, RunOutput, run_engine, run_hf
from ocm_store.memory import InMemoryStore
from service.decoding import (
    CombinedDrafter,
    Drafter,
    DraftPolicy,
    Engine,
    HeadDrafter,
    LoadedModel,
    ModelDrafter,
    NgramDrafter,
    SpeculativeConfig,
)
from service.decoding.draft_head import EMBEDDED_HEAD_DIR
from service.decoding.draft_policy import ForwardCosts, measure_forward_costs


def head_folder(config: BenchConfig) -> tuple[Path | None, str | None]:
    """(the draft head folder to load, None) or (None, why the head / combined columns are skipped).

    The embedded head is trained for the embedded target only (its hidden states and vocabulary); a folder
    given explicitly is loaded whatever the target, and `HeadDrafter` refuses one trained for another model.
    """
    if config.draft_head is None:
        return None, "--no-draft-head"
    if config.draft_head != "embedded":
        return Path(config.draft_head), None
    if config.model != "embedded":
        return None, (
            f"the embedded draft head is trained for the embedded model, not {config.model!r} (--draft-head "
            "FOLDER for one trained for it)"
        )
    if not (EMBEDDED_HEAD_DIR / "model.safetensors").is_file():
        return None, f"no draft head weights in {EMBEDDED_HEAD_DIR} yet (`python -m training` trains them)"
    return EMBEDDED_HEAD_DIR, None


@dataclass
class Bench:
    config: BenchConfig
    target: LoadedModel
    draft: LoadedModel | None
    drafters: dict[str, Drafter]
    progress: tqdm
    calibrated: InMemoryStore = field(default_factory=InMemoryStore)
    # target forward seconds for 1..k+1 tokens, for the adaptive methods' draft policy
    forward_costs: ForwardCosts | None = None
    # a float32 copy of the target where it is served in another dtype (the `vanilla-fp32` column)
    fp32_target: LoadedModel | None = None
    _embedder: SentenceEmbedder | None = None
    _scorer: LogLikelihoodScorer | None = None

    @classmethod
    def create(
        cls,
        config: BenchConfig,
        target: LoadedModel,
        draft: LoadedModel | None,
        progress: tqdm,
        head: Path | None = None,
        fp32_target: LoadedModel | None = None,
    ) -> Bench:
        """`head`: the draft head's folder; it brings the "head" and "combined" drafters (as the service
        builds them: the combined one shares the n-gram drafter). `fp32_target`: the reference copy."""
        ngram = NgramDrafter(config.ngram_min, config.ngram_max)
        drafters: dict[str, Drafter] = {"ngram": ngram}
        if head is not None:
            head_drafter = HeadDrafter(target, head)
            drafters["head"] = head_drafter
            drafters["combined"] = CombinedDrafter(ngram, head_drafter)
        if draft is not None:
            drafters["model"] = ModelDrafter(draft)
        costs = measure_forward_costs(target.model, config.speculative().num_speculative_tokens + 1)
        return cls(config, target, draft, drafters, progress, forward_costs=costs, fp32_target=fp32_target)

    @property
    def speculative(self) -> SpeculativeConfig:
        return self.config.speculative()

    @property
    def embedder(self) -> SentenceEmbedder:
        if self._embedder is None:
            self._embedder = SentenceEmbedder()
        return self._embedder

    @property
    def scorer(self) -> LogLikelihoodScorer:
        if self._scorer is None:
            # scored by the float32 copy where there is one: the reference precision judges every dtype's
            # output, the serving one's included
            self._scorer = LogLikelihoodScorer(self.fp32_target or self.target)
        return self._scorer

    def engine(self, ocm: str | None) -> Engine:
        """A fresh engine: OCM "cold" (empty), "calibrated" (a copy of the calibrated one), None (no OCM);
        the "-adaptive" kinds with a draft policy of their own. Every OCM keeps learning online while its
        engine serves, as it would in the service."""
        if ocm is None:
            return Engine(self.target, dict(self.drafters))
        if ocm == "cold":
            return engine_with_store(self.target, self.drafters, InMemoryStore())
        if ocm == "calibrated":
            return engine_with_store(self.target, self.drafters, copy_store(self.calibrated))
        if ocm == "adaptive":
            return Engine(self.target, dict(self.drafters), policy=DraftPolicy(self.forward_costs))
        if ocm == "calibrated-adaptive":
            return engine_with_store(
                self.target, self.drafters, copy_store(self.calibrated), DraftPolicy(self.forward_costs)
            )
        raise ValueError(f"unknown OCM kind {ocm!r}")

    def engines(self, specs: Sequence[MethodSpec] = ()) -> dict[str | None, Engine]:
        """Fresh engines for one experiment, one per OCM kind; and, for each of `specs` that has an OCM or a
        draft policy, one of its own under its label: no column learns from another's rescues or
        acceptance, so the order of the columns changes nothing."""
        engines: dict[str | None, Engine] = {
            kind: self.engine(kind)
            for kind in (None, "cold", "calibrated", "adaptive", "calibrated-adaptive")
        }
        for spec in specs:
            if spec.ocm is not None:
                engines[spec.label] = self.engine(spec.ocm)
            if spec.fp32_target:
                if self.fp32_target is None:
                    raise ValueError(f"{spec.label} needs the float32 copy of the target")
                engines[spec.label] = Engine(self.fp32_target, {})
        return engines

    def run(
        self,
        spec: MethodSpec,
        engines: dict[str | None, Engine],
        prompt_ids: list[int],
        max_tokens: int | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> RunOutput:
        max_tokens = max_tokens or self.config.max_tokens
        speculative = speculative or self.speculative
        if spec.runner == "hf":
            return run_hf(
                self.target, spec, prompt_ids, max_tokens, speculative.num_speculative_tokens, self.draft
            )
        engine = engines[spec.label] if spec.label in engines else engines[spec.ocm]
        return run_engine(engine, spec, prompt_ids, max_tokens, speculative)
