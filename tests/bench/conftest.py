"""A draft head for the embedded model, saved as the real files, for the head / combined columns.

The trained head may not exist on a machine (it ships once trained); the bench must work the same with any
head, so its tests use this one: a freshly initialised `RecurrentDraftHead`, whose blocks start as the identity
on the state. It drafts the target's own choice at the position it starts from (the last committed token)
again and again: accepted where the text repeats a token, rejected elsewhere, so both paths are exercised.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.decoding import LoadedModel, vocabulary_hash
from service.decoding.draft_head import DraftHeadConfig, RecurrentDraftHead

DRAFT_VOCAB = 4096  # the lowest ids: BPE merges come in frequency order, so these are the common tokens


def save_embedded_head(embedded: LoadedModel, folder: Path) -> Path:
    config = DraftHeadConfig(
        hidden_size=embedded.model.config.hidden_size,
        inner_size=64,
        num_blocks=2,
        draft_vocab_size=DRAFT_VOCAB,
        target_vocab_hash=vocabulary_hash(embedded.tokenizer),
        target_name=embedded.name,
    )
    torch.manual_seed(0)
    RecurrentDraftHead(config, torch.arange(DRAFT_VOCAB)).save(folder)
    return folder


@pytest.fixture(scope="session")
def embedded_head(embedded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_embedded_head(embedded, tmp_path_factory.mktemp("draft-head"))
