"""How much of a draft is worth verifying: speculation must never make decoding slower than not speculating.

A target forward over 1 + l tokens costs c(1 + l); on a CPU c(2) is already 1.5-2x c(1), so a draft whose
first token is usually rejected makes decoding *slower*. Per round we pick the draft prefix length l that
maximises expected tokens per second,

    (1 + sum_{i=1..l} P(first i draft tokens kept)) / c(1 + l),     l = 0 .. len(draft),

with l = 0 meaning a plain decoding step. P(first i kept) is the product of per-position survival rates
s_j = P(position j kept | position j - 1 kept), learned online per drafter and per *confidence key* (for the
n-gram drafter: the length of the matched n-gram). Rates are exponentially decayed counts with an optimistic
prior, so they follow a workload that changes. The cost table c(n) is measured once per model and machine
(`forward_costs`, cached on disk), so decisions depend on what was served, not on wall-clock noise of this
round.

When the policy chooses l = 0 it still learns nothing about drafting, so every `explore_every`-th such
decision verifies the draft anyway (a counter, not a random draw: sampling streams stay reproducible).

Greedy `sd` output does not depend on l (strict verification is lossless for any draft), so this policy
changes only speed. For `csd` it can change which tokens get a chance to be rescued.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

# measure_forward_costs is re-exported: callers (bench) know it from here
from service.decoding.forward_costs import ForwardCosts, measure_forward_costs  # noqa: F401


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
        self,
        forward_costs: ForwardCosts | Sequence[float] | None = None,
        decay: float = 0.98,
        explore_every: int = 16,
    ):
        # ForwardCosts, or a list: forward_costs[n - 1] = seconds for one row of n new tokens; None: all equal,
        # which makes drafting look free, the behaviour of a fixed num_speculative_tokens.
        if forward_costs is not None and not isinstance(forward_costs, ForwardCosts):
            forward_costs = ForwardCosts.single_row(forward_costs) if len(forward_costs) else None
        self.forward_costs: ForwardCosts | None = forward_costs
        self.decay = decay
        self.explore_every = explore_every
        self._survival: dict[tuple[str, int], _Survival] = {}
        self._skipped = 0
        self._lock = threading.Lock()

    def set_costs(self, forward_costs: ForwardCosts) -> None:
        """A refined cost table (measured in the background); the learned survival rates stay."""
        with self._lock:
            self.forward_costs = forward_costs

    def cost(self, rows: int, tokens: int) -> float | None:
        """Seconds of a forward over `rows` rows of `tokens` tokens, or None without a cost table."""
        return self.forward_costs(rows, tokens) if self.forward_costs is not None else None

    def choose(self, drafter: str, key: int, draft_len: int) -> int:
        """The draft prefix length to verify for a sequence decoded alone (0: a plain step)."""
        return self.choose_batch([(drafter, key, draft_len)], rows=1)

    def choose_batch(
        self, drafts: Sequence[tuple[str, int, int]], rows: int, max_len: int | None = None
    ) -> int:
        """One draft cap K for a batch round: every speculating row verifies min(K, its draft) tokens.

        `drafts` holds (drafter, key, available draft length) per speculating row; `rows` counts every row
        of the batch, speculating or not. The batch's forward is padded to 1 + K tokens per row, so it costs
        c(rows, 1 + K) while row r adds 1 + sum_{i<=min(K, len_r)} P_r(first i kept) tokens: K maximises
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
            cost = self.forward_costs
            best_len, best_rate, expected = 0, rows / cost(rows, 1), float(rows)
            for cap in range(1, longest + 1):
                expected += gain[cap]
                rate = expected / cost(rows, 1 + cap)
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
