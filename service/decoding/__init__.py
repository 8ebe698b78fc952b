"""The decoding core: models, drafters, verification rules and the generation loop.

Imports torch and transformers only; the service and the OCM store meet it through `DivergenceMemory`
and the plain dataclasses in `types`.
"""

from service.decoding.draft_policy import DraftPolicy
from service.decoding.drafters import Drafter, ModelDrafter, NgramDrafter
from service.decoding.engine import Engine, Generation
from service.decoding.models import LoadedModel, check_same_vocabulary, load_model, vocabulary_hash
from service.decoding.types import (
    DecodingError,
    EmittedToken,
    GenerationStats,
    GenerationStep,
    Method,
    Provenance,
    RoundStats,
    SamplingParams,
    SpeculativeConfig,
)
from service.decoding.verification import DivergenceMemory

__all__ = [
    "DecodingError",
    "DivergenceMemory",
    "DraftPolicy",
    "Drafter",
    "EmittedToken",
    "Engine",
    "Generation",
    "GenerationStats",
    "GenerationStep",
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
    "vocabulary_hash",
]
