"""How much of a draft is worth verifying: speculation must never make decoding slower than not speculating.

A target forward over 1 + l tokens costs c(1 + l); on a CPU c(2) is already 1.5-2x c(1), so a draft whose
first token is usually rejected makes decoding *slower*. Per round we pick the draft prefix length l that
maximises expected tokens per second,

    (1 + sum_{i=1..l} P(first i draft tokens kept)) / c(1 + l),     l = 0 .. len(draft),

with l = 0 meaning a plain decoding step. P(first i kept) is the product of per-position survival rates
s_j = P(position j kept | position j - 1 kept), learned online per drafter and per *confidence key* (for the
n-gram drafter: the length of the matched n-gram). Rates are exponentially decayed counts with an optimistic
prior, so they follow a workload that changes. The cost table c(n) is measured once at start
(`measure_forward_costs`), so decisions depend on what was served, not on wall-clock noise of this round.

When the policy chooses l = 0 it still learns nothing about drafting, so every `explore_every`-th such
decision verifies the draft anyway (a counter, not a random draw: sampling streams stay reproducible).

Greedy `sd` output does not depend on l (strict verification is lossless for any draft), so this policy
changes only speed. For `csd` it can change which tokens get a chance to be rescued.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from service.decoding.kv_cache import crop_cache


@dataclass
class _Survival:
    """Decayed tallies of 'position i kept given i - 1 kept', i = 1..k."""

    trials: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)

    # An optimistic prior (worth two rounds that kept 80 %): a drafter nobody has seen yet gets tried, and
    # a few rejections are enough to outweigh it.
    PRIOR_RATE = 0.8
    PRIOR_WEIGHT = 2.0

    def rate(self, i: int) -> float:
        trials = self.trials[i] if i < len(self.trials) else 0.0
        kept = self.kept[i] if i < len(self.kept) else 0.0
        return (kept + self.PRIOR_RATE * self.PRIOR_WEIGHT) / (trials + self.PRIOR_WEIGHT)

    def observe(self, drafted: int, kept: int, decay: float) -> None:
        while len(self.trials) < drafted:
            self.trials.append(0.0)
            self.kept.append(0.0)
        for i in range(min(drafted, kept + 1)):  # positions past the first rejection were not tried
            self.trials[i] = self.trials[i] * decay + 1.0
            self.kept[i] = self.kept[i] * decay + float(i < kept)


class DraftPolicy:
    """Chooses how many draft tokens to verify; shared by every generation of one engine (thread-safe)."""

    def __init__(
        self, forward_costs: Sequence[float] | None = None, decay: float = 0.98, explore_every: int = 16
    ):
        # forward_costs[n - 1] = seconds for a target forward over n new tokens (n = 1..); None: all equal,
        # which makes drafting look free, the behaviour of a fixed num_speculative_tokens.
        self.forward_costs = list(forward_costs) if forward_costs else None
        self.decay = decay
        self.explore_every = explore_every
        self._survival: dict[tuple[str, int], _Survival] = {}
        self._skipped = 0
        self._lock = threading.Lock()

    def _cost(self, n: int) -> float:
        if not self.forward_costs:
            return 1.0
        if n <= len(self.forward_costs):
            return self.forward_costs[n - 1]
        # Past the measured sizes a forward's cost grows about linearly in its tokens.
        return self.forward_costs[-1] * n / len(self.forward_costs)

    def choose(self, drafter: str, key: int, draft_len: int) -> int:
        """The draft prefix length to verify for a sequence decoded alone (0: a plain step)."""
        return self.choose_batch([(drafter, key, draft_len)], rows=1)

    def choose_batch(
        self, drafts: Sequence[tuple[str, int, int]], rows: int, max_len: int | None = None
    ) -> int:
        """One draft cap K for a batch round: every speculating row verifies min(K, its draft) tokens.

        `drafts` holds (drafter, key, available draft length) per speculating row; `rows` counts every row
        of the batch, speculating or not. The batch's forward is padded to 1 + K tokens per row, so it costs
        c(rows * (1 + K)) while row r adds 1 + sum_{i<=min(K, len_r)} P_r(first i kept) tokens: K maximises
        their ratio, and K = 0 (no speculation at all) wins whenever drafts do not pay for the wider forward,
        which at large batch sizes or low acceptance is the usual case.
        """
        longest = max((length for _, _, length in drafts), default=0)
        if max_len is not None:
            longest = min(longest, max_len)
        if longest <= 0 or not self.forward_costs:
            return max(longest, 0)
        with self._lock:
            # gain[K] = expected extra tokens the batch emits with cap K
            gain = [0.0] * (longest + 1)
            for drafter, key, length in drafts:
                survival = self._survival.get((drafter, key)) or _Survival()
                p_prefix = 1.0
                for i in range(min(length, longest)):
                    p_prefix *= survival.rate(i)
                    gain[i + 1] += p_prefix
            best_len, best_rate, expected = 0, rows / self._cost(rows), float(rows)
            for cap in range(1, longest + 1):
                expected += gain[cap]
                rate = expected / self._cost(rows * (1 + cap))
                if rate > best_rate:
                    best_len, best_rate = cap, rate
            if best_len == 0:
                self._skipped += 1
                if self._skipped % self.explore_every == 0:
                    return longest
            return best_len

    def observe(self, drafter: str, key: int, drafted: int, kept: int) -> None:
        if drafted == 0:
            return
        with self._lock:
            self._survival.setdefault((drafter, key), _Survival()).observe(drafted, kept, self.decay)


def measure_forward_costs(
    model: torch.nn.Module, max_tokens: int, context: int = 64, repeats: int = 2, dense: int | None = None
) -> list[float]:
    """Seconds of a target forward over n = 1..max_tokens new tokens after `context` cached ones (min of
    `repeats`). Sizes up to `dense` (default: all) are measured one by one, larger ones at doubling sizes and
    interpolated: a batch of B rows verifying 1 + k tokens each is costed as one forward over B * (1 + k)
    tokens (the projections dominate; attention over short contexts is a small share). A few seconds on a CPU;
    run once at start."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    dense = max_tokens if dense is None else min(dense, max_tokens)
    sizes = list(range(1, dense + 1))
    while sizes[-1] < max_tokens:
        sizes.append(min(sizes[-1] * 2, max_tokens))
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=generator).to(device)
    measured: list[float] = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=prefix, cache=cache, logits_to_keep=1)
        model(input_ids=prefix[:, :1], cache=cache)  # warm-up of the single-token path
        crop_cache(cache, context)
        for n in sizes:
            ids = torch.randint(0, vocab, (1, n), generator=generator).to(device)
            best = float("inf")
            for _ in range(repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
                model(input_ids=ids, cache=cache)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - started)
                crop_cache(cache, context)
            measured.append(best)
    # A forward over more tokens never costs less: smooth out measurement noise.
    for i in range(1, len(measured)):
        measured[i] = max(measured[i], measured[i - 1])
    costs: list[float] = []
    for n in range(1, max_tokens + 1):
        j = next(i for i, size in enumerate(sizes) if size >= n)
        if sizes[j] == n:
            costs.append(measured[j])
        else:  # between sizes[j - 1] and sizes[j]
            lo, hi = sizes[j - 1], sizes[j]
            costs.append(measured[j - 1] + (measured[j] - measured[j - 1]) * (n - lo) / (hi - lo))
    return costs
