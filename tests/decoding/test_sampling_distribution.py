"""Engine-level sampling with `sd` follows the target's distribution (Leviathan/Chen are lossless).

A tiny Llama over a 12-word vocabulary makes the exact distribution of the first generated tokens cheap to
compute from the model's own probabilities: the marginal of token j sums over every earlier token, 12^(j-1)
prefixes in one batched forward. We then sample the same positions many times through the whole engine
(drafter, one target forward per round, verification, cache rollback, budget clipping) and compare.

The prompt is chosen so that the n-gram drafter proposes on the first round, and so that those draft tokens
are neither near-certain nor near-impossible under the target: both the accept and the reject branch of
rejection sampling run often enough to be tested.

Note that treating a sampled draft as a point mass would also be lossless (only less efficient), so this
test pins the distribution, not the acceptance rate.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from service.decoding import (
    Engine,
    ModelDrafter,
    NgramDrafter,
    Provenance,
    SamplingParams,
    SpeculativeConfig,
    run_alone,
)
from tests.conftest import make_word_model

TEMPERATURE = 1.2
POSITIONS = 3  # generated positions whose marginals we test (max_tokens)
# 1000 samples reject a sampler that draws the recovered token from the target's distribution instead of
# the residual norm(max(0, target_probs - draft_probs)) with p < 1e-15 (checked when this test was written).
SAMPLES = 1000
# The largest chi-square p-value we still call a failure. Seeds are fixed, so the test is deterministic;
# this only says how unlikely a correct sampler must look before we blame it.
MIN_P_VALUE = 1e-4

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    return make_word_model(seed=0, layers=1)


@pytest.fixture(scope="module")
def draft(target):
    return make_word_model(seed=1, tokenizer=target.tokenizer, layers=1)


def next_probs(model, prefixes: torch.Tensor) -> torch.Tensor:
    """prefixes: [B, L] -> the target's sampling distribution of the next token, [B, V] in float64."""
    with torch.inference_mode():
        logits = model.model(input_ids=prefixes).logits[:, -1].double()
    return torch.softmax(logits / TEMPERATURE, dim=-1)


def exact_marginals(model, prompt: list[int], positions: int) -> list[torch.Tensor]:
    """Marginal distribution of each of the first `positions` generated tokens, summing over prefixes."""
    vocab = model.model.config.vocab_size
    marginals = []
    # joint probability of every generated prefix so far: {tuple of tokens: probability}
    joint = {(): 1.0}
    for _ in range(positions):
        prefixes = list(joint)
        batch = torch.tensor([prompt + list(p) for p in prefixes])
        probs = next_probs(model, batch)  # [len(prefixes), V]
        weights = torch.tensor([joint[p] for p in prefixes], dtype=torch.float64)
        marginals.append(weights @ probs)
        joint = {
            p + (t,): joint[p] * float(probs[i, t]) for i, p in enumerate(prefixes) for t in range(vocab)
        }
    return marginals


def choose_prompt(model) -> list[int]:
    """A prompt `x y a b u v x y`, with (a, b) picked so that the n-gram drafter's proposal [a, b] is
    plausible but uncertain under the target (probability of each draft token well inside (0, 1))."""
    x, y, u, v = 2, 3, 9, 10
    candidates = [(a, b) for a, b in itertools.product(range(2, 12), repeat=2) if len({a, b, x, y}) == 4]
    prompts = [[x, y, a, b, u, v, x, y] for a, b in candidates]
    p_first = next_probs(model, torch.tensor(prompts))
    p_second = next_probs(model, torch.tensor([p + [c[0]] for p, c in zip(prompts, candidates, strict=True)]))
    # how likely the target is to keep both draft tokens, at best; aim for an even chance
    scores = [min(float(p_first[i, a]), float(p_second[i, b])) for i, (a, b) in enumerate(candidates)]
    best = min(range(len(candidates)), key=lambda i: abs(scores[i] - 0.5))
    return prompts[best]


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test; cells expected fewer than 5 times are pooled so the chi-square law holds."""
    n = float(counts.sum())
    expected = expected_probs * n
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    expected = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def sample_positions(engine: Engine, prompt, drafter: str, samples: int):
    vocab = engine.target.model.config.vocab_size
    counts = torch.zeros(POSITIONS, vocab, dtype=torch.float64)
    provenance_at_first = {p: 0 for p in Provenance}
    drafted = 0
    for seed in range(samples):
        sampling = SamplingParams(max_tokens=POSITIONS, temperature=TEMPERATURE, seed=seed, ignore_eos=True)
        generation = engine.generate(prompt, sampling, SpeculativeConfig(method="sd"), drafter)
        for _ in run_alone(generation):
            pass
        assert len(generation.tokens) == POSITIONS
        for position, token in enumerate(generation.tokens):
            counts[position, token.token_id] += 1
        provenance_at_first[generation.tokens[0].provenance] += 1
        drafted += generation.stats.num_draft_tokens
    return counts, provenance_at_first, drafted


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_sd_sampling_follows_target_distribution(target, draft, drafter):
    prompt = choose_prompt(target)
    engine = Engine(target, {"ngram": NgramDrafter(), "model": ModelDrafter(draft)})
    counts, first, drafted = sample_positions(engine, prompt, drafter, SAMPLES)
    marginals = exact_marginals(target, prompt, POSITIONS)

    # The test exercised speculation: drafts were proposed, and at the first position both kept and
    # rejected drafts happened often (else we would only be testing plain sampling).
    assert drafted >= SAMPLES
    assert first[Provenance.ACCEPTED] > SAMPLES // 20, first
    assert first[Provenance.RECOVERED] > SAMPLES // 20, first

    for position in range(POSITIONS):
        p_value = chi_square_p_value(counts[position], marginals[position])
        empirical = (counts[position] / SAMPLES).tolist()
        assert p_value > MIN_P_VALUE, (
            f"position {position + 1}: p = {p_value:.2e}\n"
            f"empirical {[round(x, 3) for x in empirical]}\n"
            f"exact     {[round(x, 3) for x in marginals[position].tolist()]}"
        )


@pytest.mark.parametrize("method, drafter", [("vanilla", "ngram"), ("sd", "ngram"), ("sd", "model")])
def test_seeded_sampling_is_reproducible(target, draft, method, drafter):
    engine = Engine(target, {"ngram": NgramDrafter(), "model": ModelDrafter(draft)})
    prompt = choose_prompt(target)

    def tokens(seed: int) -> tuple[int, ...]:
        sampling = SamplingParams(max_tokens=16, temperature=TEMPERATURE, seed=seed, ignore_eos=True)
        generation = engine.generate(prompt, sampling, SpeculativeConfig(method=method), drafter)
        for _ in run_alone(generation):
            pass
        return tuple(t.token_id for t in generation.tokens)

    first = tokens(7)
    assert tokens(7) == first
    assert len({first, tokens(8), tokens(9), tokens(10)}) > 1
