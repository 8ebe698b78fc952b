"""The early-exit draft model: the target's own first layers behind a trained exit, loaded from a folder (or
`embedded-exit`, the shipped one) by the same `load_model` as any model, in the target's executor; what it
computes is the target's layer-N state through norm(h + h A) and the target's LM head."""

from __future__ import annotations

import os

import pytest
import torch

from service.decoding.types import DecodingError
from service.executor.early_exit import EXIT_WEIGHTS, final_rms_norm, save_exit
from service.executor.models import load_model
from service.executor.paths import EMBEDDED_EXIT_DIR, check_model_spec, exit_folder

WEIGHTS = os.environ.get("CSD_WEIGHTS", "auto")  # as the `embedded` fixture loads the target

pytestmark = pytest.mark.usefixtures("single_thread")


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_an_exit_model_is_the_targets_first_layers_behind_its_exit(embedded, tmp_path):
    decoder = embedded.model.get_decoder()
    rms = final_rms_norm(embedded.model)
    hidden = rms.weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    adapter = 0.05 * torch.randn(hidden, hidden, generator=generator)
    scale = rms.weight.detach().float() * (1 + 0.1 * torch.rand(hidden, generator=generator))
    save_exit(tmp_path / "exit", "embedded", 3, adapter, scale)
    assert exit_folder(str(tmp_path / "exit")) == tmp_path / "exit"
    check_model_spec(str(tmp_path / "exit"))

    draft = load_model(str(tmp_path / "exit"), weights=WEIGHTS)
    assert len(draft.model.get_decoder().layers) == 3 and draft.weights == embedded.weights
    assert draft.revision.startswith(embedded.revision + "+exit3-") and draft.identity != embedded.identity
    assert draft.tokenizer.get_vocab() == embedded.tokenizer.get_vocab()

    ids = torch.tensor(
        [embedded.tokenizer("The capital of France is Paris, and the capital of")["input_ids"]]
    )
    captured = {}
    hook = decoder.layers[2].register_forward_hook(lambda m, a, out: captured.__setitem__("h", out))
    try:
        with torch.inference_mode():
            embedded.model(input_ids=ids, use_cache=False)
            got = draft.model(input_ids=ids, use_cache=False).logits.float()
    finally:
        hook.remove()
    h = (captured["h"][0] if isinstance(captured["h"], tuple) else captured["h"]).float()
    expected = embedded.model.get_output_embeddings()(
        (_rms(h + h @ adapter, rms.variance_epsilon) * scale).to(h.dtype)
    ).float()
    assert torch.allclose(got, expected, atol=2e-2, rtol=1e-3), (got - expected).abs().max()
    # the target itself is untouched: its final norm is its own
    assert type(decoder.norm).__name__ != "ExitNorm" and len(decoder.layers) > 3


def test_a_broken_exit_folder_is_refused_with_what_is_wrong(tmp_path):
    folder = tmp_path / "exit"
    save_exit(folder, "embedded", 2, torch.zeros(8, 8), torch.ones(8))
    with pytest.raises(DecodingError, match="does not hold an exit for hidden size 576"):
        load_model(str(folder), weights=WEIGHTS)
    save_exit(folder, "embedded", 31, torch.zeros(576, 576), torch.ones(576))  # deeper than the model
    with pytest.raises(DecodingError, match="cannot keep 31 layers of 'embedded': it has 30"):
        load_model(str(folder), weights=WEIGHTS)
    (folder / EXIT_WEIGHTS).unlink()
    with pytest.raises(DecodingError, match="has no exit.safetensors"):
        load_model(str(folder))
    (folder / "exit.json").write_text("{not json")
    with pytest.raises(DecodingError, match="is not an exit's config"):
        load_model(str(folder))


@pytest.mark.skipif(not (EMBEDDED_EXIT_DIR / "exit.json").exists(), reason="no exit shipped")
def test_the_shipped_exit_agrees_with_the_target_far_more_than_plain_early_exit(embedded, tmp_path):
    """`embedded-exit` loads offline from the package; on the target's own answer to a chat prompt its
    greedy next token agrees with the target's far more often than plain early exit at the same depth (its
    card: 34 % against 10 % on unseen chat)."""
    from service.decoding import Engine, SamplingParams, SpeculativeConfig, run_alone
    from service.decoding.text import encode_chat

    draft = load_model("embedded-exit", weights=WEIGHTS)
    layers = len(draft.model.get_decoder().layers)
    hidden = final_rms_norm(embedded.model).weight.shape[0]
    save_exit(
        tmp_path / "plain",
        "embedded",
        layers,
        torch.zeros(hidden, hidden),
        final_rms_norm(embedded.model).weight,
    )
    plain = load_model(str(tmp_path / "plain"), weights=WEIGHTS)
    prompt = encode_chat(
        embedded.tokenizer,
        [{"role": "user", "content": "Explain how a bicycle's gears make climbing hills easier."}],
    )
    generation = Engine(embedded).generate(
        prompt, SamplingParams(max_tokens=96), SpeculativeConfig(method="vanilla")
    )
    list(run_alone(generation))
    answer = [t.token_id for t in generation.tokens]
    ids = torch.tensor([prompt + answer])
    with torch.inference_mode():
        span = slice(len(prompt) - 1, len(prompt) + len(answer) - 1)
        agree = {
            name: float(
                (
                    model.model(input_ids=ids, use_cache=False).logits[0, span].argmax(-1)
                    == torch.tensor(answer)
                )
                .float()
                .mean()
            )
            for name, model in (("exit", draft), ("plain", plain))
        }
    assert agree["exit"] >= agree["plain"] + 0.1 and agree["exit"] >= 0.2, agree
