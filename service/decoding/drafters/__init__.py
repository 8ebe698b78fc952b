"""Drafters: what proposes the tokens a target forward verifies (the boundary is in `base`).

- `ngram`: prompt lookup (training-free, nearly free; wins where the output copies the prompt);
- `head`: the recurrent draft head trained for the embedded target, on the target's hidden states;
- `model`: any causal LM sharing the target's vocabulary;
- `combined`: prompt lookup where it matches, the head elsewhere.
"""

from service.decoding.drafters.base import BatchDrafter, Draft, Drafter, DraftRow
from service.decoding.drafters.combined import CombinedDrafter
from service.decoding.drafters.head import HeadDrafter
from service.decoding.drafters.model import ModelDrafter, ModelDraftRows
from service.decoding.drafters.ngram import NgramDrafter, NgramIndex

__all__ = [
    "BatchDrafter",
    "CombinedDrafter",
    "Draft",
    "DraftRow",
    "Drafter",
    "HeadDrafter",
    "ModelDraftRows",
    "ModelDrafter",
    "NgramDrafter",
    "NgramIndex",
]
