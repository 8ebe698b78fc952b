"""What one benchmark run measures: the full run and the --quick preset."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.workloads import WORKLOADS

if TYPE_CHECKING:
    from service.decoding import SpeculativeConfig


class BenchError(Exception):
    """A user-facing failure (bad option, missing package): printed as one line."""


SWEEP_TAUS = (0.01, 0.05, 0.1, 0.3)
SWEEP_LAMBDAS = (2, 6, 12)


@dataclass
class BenchConfig:
    model: str = "embedded"
    draft_model: str | None = None
    workloads: tuple[str, ...] = WORKLOADS
    limit: int | None = None  # prompts per workload (None: all)
    max_tokens: int = 128
    # speculation: the paper's defaults
    num_speculative_tokens: int = 6
    lambda_: float = 6
    tau: float = 0.01
    lossy_threshold: float = 0.6
    ngram_min: int = 1  # the service default (service/config.py)
    ngram_max: int = 4
    # the trained draft head ("embedded": the shipped one, when the target is the embedded model and its weights
    # exist; a folder; None: no head columns)
    draft_head: str | None = "embedded"
    # OCM calibration on bench/data/calibration.jsonl (never the evaluation prompts)
    calibration_prompts: int | None = None
    calibration_max_tokens: int = 128
    # tau/lambda sweep on the last calibration prompts, held out of the OCM calibration (bench/sweep.py)
    sweep_taus: tuple[float, ...] = SWEEP_TAUS
    sweep_lambdas: tuple[float, ...] = SWEEP_LAMBDAS
    sweep_prompts: int = 8
    sweep_drafters: tuple[str, ...] = ()  # () : every drafter the run has
    sweep_unguarded: bool = False  # one more point per drafter: the run's tau / lambda without the guards
    # online learning: the grounded suite, shuffled, replayed this many times through csd from a cold OCM
    replay_passes: int = 3
    replay_prompts: int | None = None
    peer: bool = True  # transformers' own generate
    methods: tuple[str, ...] | None = None  # method columns to run (None: all)
    humaneval_timeout: float = 3.0
    threads: int | None = None
    seed: int = 0
    out_dir: Path | None = None  # default: bench/results/<timestamp>
    quick: bool = False
    extra: dict = field(default_factory=dict)

    @classmethod
    def quick_preset(cls, **overrides: object) -> BenchConfig:
        """Two prompts per workload, short outputs, a small sweep: a few minutes on 2 quiet CPU cores."""
        values: dict = dict(
            quick=True,
            limit=2,
            max_tokens=32,
            calibration_prompts=8,
            calibration_max_tokens=32,
            sweep_prompts=1,
            replay_passes=2,
            replay_prompts=3,
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def speculative(self) -> SpeculativeConfig:
        from service.decoding import SpeculativeConfig

        return SpeculativeConfig(
            num_speculative_tokens=self.num_speculative_tokens,
            lambda_=self.lambda_,
            tau=self.tau,
            lossy_threshold=self.lossy_threshold,
        )

    def as_dict(self) -> dict:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir) if self.out_dir else None
        return d
