"""The decoding core: drafters, verification rules, the draft policy and the generation loop.

It runs the models through `service.executor` (loading, kernels, KV layout, forward costs) and re-exports
its loading entry points. Imports torch and transformers only; the service and the OCM store meet it through `CorrectionMemory`
and the plain dataclasses in `types`.
"""

import importlib
from typing import TYPE_CHECKING

# Exports resolve lazily (PEP 562): `service.decoding.types` and `service.executor.paths` are imported by the settings and
# the CLI, which must not pay torch's import time for `csd ocm stats`.
_EXPORTS = {
    "Batch": "batch",
    "DraftPolicy": "draft_policy",
    "CombinedDrafter": "drafters",
    "Drafter": "drafters",
    "HeadDrafter": "drafters",
    "ModelDrafter": "drafters",
    "NgramDrafter": "drafters",
    "Engine": "engine",
    "run_alone": "engine",
    "Generation": "generation",
    "LoadedModel": "service.executor.models",
    "check_same_vocabulary": "service.executor.models",
    "load_model": "service.executor.models",
    "vocabulary_hash": "service.executor.models",
    "Constraint": "types",
    "ConstraintKind": "types",
    "DecodingError": "types",
    "EmittedToken": "types",
    "GenerationRound": "types",
    "GenerationStats": "types",
    "Method": "types",
    "Provenance": "types",
    "RoundStats": "types",
    "SamplingParams": "types",
    "SpeculativeConfig": "types",
    "CorrectionMemory": "verification",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'service.decoding' has no attribute {name!r}")
    if "." not in module:
        module = f"service.decoding.{module}"
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from service.decoding.batch import Batch
    from service.decoding.draft_policy import DraftPolicy
    from service.decoding.drafters import CombinedDrafter, Drafter, HeadDrafter, ModelDrafter, NgramDrafter
    from service.decoding.engine import Engine, run_alone
    from service.decoding.generation import Generation
    from service.decoding.types import (
        Constraint,
        ConstraintKind,
        DecodingError,
        EmittedToken,
        GenerationRound,
        GenerationStats,
        Method,
        Provenance,
        RoundStats,
        SamplingParams,
        SpeculativeConfig,
    )
    from service.decoding.verification import CorrectionMemory
    from service.executor.models import LoadedModel, check_same_vocabulary, load_model, vocabulary_hash

__all__ = [
    "Batch",
    "CombinedDrafter",
    "Constraint",
    "ConstraintKind",
    "CorrectionMemory",
    "DecodingError",
    "DraftPolicy",
    "Drafter",
    "EmittedToken",
    "Engine",
    "Generation",
    "GenerationRound",
    "GenerationStats",
    "HeadDrafter",
    "LoadedModel",
    "Method",
    "ModelDrafter",
    "NgramDrafter",
    "Provenance",
    "RoundStats",
    "SamplingParams",
    "SpeculativeConfig",
    "check_same_vocabulary",
    "load_model",
    "run_alone",
    "vocabulary_hash",
]
