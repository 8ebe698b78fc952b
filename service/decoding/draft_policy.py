"""How much of a draft is worth verifying: speculation must never make decoding slower than not speculating.

A target forward over 1 + l tokens costs c(1 + l); on a CPU c(2) is already 1.5-2x c(1), so a draft whose
first token is usually rejected makes decoding *slower*. Per round we pick the draft prefix length l that
maximises expected tokens per second,

    (1 + sum_{i=1..l} P(first i draft tokens kept)) / c(1 + l),     l = 0 .. len(draft),

with l = 0 meaning a plain decoding round. P(first i kept) is the product of per-position survival rates
s_j = P(position j kept | position j - 1 kept), learned online per drafter and per *confidence key* (for the
n-gram drafter: the length of the matched n-gram). Rates are exponentially decayed counts with an optimistic
prior, so they follow a workload that changes. The cost table c(n) is measured once per model and machine
(`forward_costs`, cached on disk), so decisions depend on what was served, not on wall-clock noise of this
round.

In a batch (`choose_rows`) each row's survival is its own: the drafter's per-key rates as a prior, updated
by the row's decayed tallies, so a sequence whose drafter does well is what the batch's draft cap K is
chosen for, and one whose drafter misses does not drag it to 0; K is chosen for the batch's measured cost
c(rows, 1 + K) of the padded forward, and every speculating row verifies up to K of its draft.

When the policy chooses l = 0 it still learns nothing about drafting, so every `explore_every`-th such
decision verifies the draft anyway (a counter, not a random draw: sampling streams stay reproducible).

**How far to draft at all** (`draft_length`, asked before the drafters run): a draft costs its drafter's time
whether or not it is verified. The trained head spends a small forward a position (about 1 ms on a CPU beside
a ~18 ms target forward), and measured on an AVX2 EPYC it drafted six positions every round while the cap
above then verified none in half the rounds: the served default decoded slower than plain decoding. So the
policy also learns what a drafted position costs each drafter (seconds per position, measured per call) and
how often each confidence key comes out of it (none: an empty draft), and drafts L positions where

    sum_k f_k (rows + G_k(K_k)) / (sum_k f_k c(rows, 1 + K_k) + d L),   K_k = the cap it would choose for key k

beats a plain round (L = 0), with f_k the decayed frequency of key k, G_k the expected extra tokens of key k's
rows, and d the drafter's cost per position. Drafting reveals the key, and the cap then chooses per key: that
option value is what makes a drafter worth running although it is usually capped to 0. A drafter that costs
next to nothing (prompt lookup: under FREE_DRAFT of a forward) always drafts its full budget, so a key it never
showed (a long match) still reaches the cap. L = 0 is explored like a cap of 0.

Greedy `sd` output does not depend on l (strict verification is lossless for any draft), so this policy
changes only speed. For `csd` it can change which tokens get a chance to be rescued.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

# measure_forward_costs is re-exported: callers (bench) know it from here
from service.executor.forward_costs import ForwardCosts, measure_forward_costs  # noqa: F401


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


# A drafter whose whole draft costs less than this share of a plain forward drafts its budget whatever its
# drafts were worth so far (`DraftPolicy.draft_length`): prompt lookup's ~0.02 ms beside a ~15 ms forward
FREE_DRAFT = 0.01

# The drafter's per-key rates count as this many rounds of a row's own evidence: a sequence's own acceptance
# takes over after a few rounds (its decay is faster than the policy's, see RowAcceptance).
ROW_PRIOR_WEIGHT = 1.0


class RowAcceptance:
    """One sequence's own decayed tallies of 'draft position i kept given i - 1 kept' (all its drafts, every
    key): what makes its draft cap its own. Kept by the `Generation`, updated after each verified draft."""

    DECAY = 0.9  # a sequence's drafting luck changes with what it writes: remember ~10 rounds

    def __init__(self) -> None:
        self._trials: list[float] = []
        self._kept: list[float] = []

    def tallies(self, i: int) -> tuple[float, float]:
        """(decayed trials, decayed kept) at draft position i (0-based)."""
        if i >= len(self._trials):
            return 0.0, 0.0
        return self._trials[i], self._kept[i]

    def observe(self, drafted: int, kept: int) -> None:
        while len(self._trials) < drafted:
            self._trials.append(0.0)
            self._kept.append(0.0)
        for i in range(min(drafted, kept + 1)):  # positions past the first rejection were not tried
            self._trials[i] = self._trials[i] * self.DECAY + 1.0
            self._kept[i] = self._kept[i] * self.DECAY + float(i < kept)


@dataclass
class RowOffer:
    """A speculating row of a round: its drafter, the draft's confidence key, the draft's length, and the
    row's own acceptance (None: judged by the drafter's rates alone)."""

    drafter: str
    key: int
    length: int
    own: RowAcceptance | None = None


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
        # per drafter: decayed counts of the keys its drafts came out with (None: an empty draft), and its
        # measured seconds per drafted position (see `draft_length`)
        self._keys: dict[str, dict[int | None, float]] = {}
        self._draft_seconds: dict[str, float] = {}
        self._undrafted: dict[str, int] = {}
        self._lock = threading.Lock()

    def set_costs(self, forward_costs: ForwardCosts) -> None:
        """A refined cost table (measured in the background); the learned survival rates stay."""
        with self._lock:
            self.forward_costs = forward_costs

    def cost(self, rows: int, tokens: int) -> float | None:
        """Seconds of a forward over `rows` rows of `tokens` tokens, or None without a cost table."""
        return self.forward_costs(rows, tokens) if self.forward_costs is not None else None

    def choose(self, drafter: str, key: int, draft_len: int) -> int:
        """The draft prefix length to verify for a sequence decoded alone (0: a plain round)."""
        return self.choose_batch([(drafter, key, draft_len)], rows=1)

    def choose_batch(
        self, drafts: Sequence[tuple[str, int, int]], rows: int, max_len: int | None = None
    ) -> int:
        """One draft cap K for a batch round whose rows carry no acceptance of their own (see
        `choose_rows`): every speculating row verifies min(K, its draft) tokens."""
        offers = [RowOffer(drafter, key, length) for drafter, key, length in drafts]
        return max(self.choose_rows(offers, rows, max_len), default=0)

    def choose_rows(self, offers: Sequence[RowOffer], rows: int, max_len: int | None = None) -> list[int]:
        """Each speculating row's draft cap for this round (the batch's cap K, or its shorter draft), from
        the rows' own acceptance and the batch's forward cost.

        `offers` holds one `RowOffer` per speculating row; `rows` counts every row of the batch, speculating
        or not. Row r keeps its first i draft tokens with probability P_r(i), the product of its survival
        rates: the drafter's per-key rates (what every sequence taught the policy) as a prior of weight
        `ROW_PRIOR_WEIGHT`, updated by the row's own decayed tallies (`RowAcceptance`), so a sequence whose
        drafter does well keeps the batch drafting even where that drafter usually misses, and a batch whose
        rows all miss decodes plainly although their drafter usually hits. The batch's forward is padded to 1 + K tokens per row
        (batch_kv.py), so it costs c(rows, 1 + K) whichever rows fill the width: K maximises
        (rows + sum_r sum_{i <= min(K, len_r)} P_r(i)) / c(rows, 1 + K), and K = 0 (a plain round for all)
        wins whenever the drafts do not pay for the wider forward. Row r then verifies min(K, len_r).

        No row verifies less than that: the forward is 1 + K wide whichever rows fill it, so a row's shorter
        cap saves no forward time and only loses its chance of more tokens; and where a row alone sets the
        width (one row), K already weighs each extra token's survival against c(1 + K). An earlier per-row
        tail cut (survival below 10 %) overrode that choice: in bf16 at one row it cost about 5 % of the
        tokens per forward (docs/benchmarks.md). Which tokens a lossy rule (csd) may keep is its gates'
        business (OCM, SCG, guards), not this speed policy's.
        """
        lengths = [offer.length for offer in offers]
        longest = max(lengths, default=0)
        if max_len is not None:
            longest = min(longest, max_len)
        if longest <= 0 or not self.forward_costs:
            return [max(0, min(length, longest)) for length in lengths]
        with self._lock:
            # prefix[r][i - 1] = P_r(first i kept); gain[K] = expected extra tokens the batch emits with cap K
            prefix = [self._prefix(offer, min(offer.length, longest)) for offer in offers]
            gain = [0.0] * (longest + 1)
            for probs in prefix:
                for i, p in enumerate(probs):
                    gain[i + 1] += p
            cost = self.forward_costs
            best_len, best_rate, expected = 0, rows / cost(rows, 1), float(rows)
            for cap in range(1, longest + 1):
                expected += gain[cap]
                rate = expected / cost(rows, 1 + cap)
                if rate > best_rate:
                    best_len, best_rate = cap, rate
            if best_len == 0:
                self._skipped += 1
                if self._skipped % self.explore_every == 0:  # explore: every draft in full
                    return [min(length, longest) for length in lengths]
                return [0] * len(offers)
        return [min(best_len, length) for length in lengths]

    # the measured cost of a drafted position follows this many calls (exponential moving average)
    DRAFT_COST_DECAY = 0.9

    def observe_drafting(
        self, drafter: str, seconds: float, keys: Sequence[int | None], positions: int
    ) -> None:
        """One `propose` call of `drafter`: its wall time, the key of each row's draft (None: empty) and the
        longest draft's length (the positions it ran)."""
        with self._lock:
            counts = self._keys.setdefault(drafter, {})
            for key in keys:
                for seen in counts:
                    counts[seen] *= self.decay
                counts[key] = counts.get(key, 0.0) + 1.0
            if positions > 0:
                per_position = seconds / positions
                old = self._draft_seconds.get(drafter)
                self._draft_seconds[drafter] = (
                    per_position
                    if old is None
                    else self.DRAFT_COST_DECAY * old + (1 - self.DRAFT_COST_DECAY) * per_position
                )

    def draft_length(self, drafter: str, speculating: int, rows: int, budget: int) -> tuple[int, bool]:
        """How many positions `drafter` should draft this round for its `speculating` rows of a batch of
        `rows` (each row's own budget still caps its draft): the L of the module's docstring, at most
        `budget`, and whether this is an exploration (L = 0 chosen, the whole budget drafted anyway: its
        drafts are then verified in full, or the survival rates that said 0 could never learn otherwise).
        Without a cost table, before the drafter's first call, or for a drafter that costs nothing: the
        whole budget."""
        if budget <= 0 or not self.forward_costs or speculating <= 0:
            return max(0, budget), False
        with self._lock:
            per_position = self._draft_seconds.get(drafter)
            counts = self._keys.get(drafter)
            cost = self.forward_costs
            if per_position is None or not counts or per_position * budget < FREE_DRAFT * cost(rows, 1):
                # unmeasured, or as good as free (prompt lookup): draft the budget and let the cap decide on
                # the draft's key, which only drafting reveals (a long match the policy has not seen yet)
                return budget, False
            total = sum(counts.values())
            # per key: its frequency and its rows' expected extra tokens at each cap 1..budget
            mix = []
            for key, count in counts.items():
                gains = [0.0] * (budget + 1)
                if key is not None:
                    probs = self._prefix(RowOffer(drafter, key, budget), budget)
                    for i, p in enumerate(probs):
                        gains[i + 1] = gains[i] + speculating * p
                mix.append((count / total, gains, 0, rows / cost(rows, 1)))  # (f, gains, cap, its rate)
            plain = rows / cost(rows, 1)
            best_length, best_rate = 0, plain
            for length in range(1, budget + 1):
                tokens = seconds = 0.0
                for j, (f, gains, cap, rate) in enumerate(mix):
                    candidate = (rows + gains[length]) / cost(rows, 1 + length)
                    if candidate > rate:  # the cap this key's rows would choose, given `length` drafted
                        cap, rate = length, candidate
                        mix[j] = (f, gains, cap, rate)
                    tokens += f * (rows + gains[cap])
                    seconds += f * cost(rows, 1 + cap)
                drafted = tokens / (seconds + per_position * length)
                if drafted > best_rate:
                    best_length, best_rate = length, drafted
            if best_length == 0:
                skipped = self._undrafted[drafter] = self._undrafted.get(drafter, 0) + 1
                if skipped % self.explore_every == 0:  # explore: draft in full now and then
                    return budget, True
            return best_length, False

    def forget(self, drafter: str) -> None:
        """Drop what was learnt of `drafter` (survival per key, its keys' frequencies, a position's cost):
        its weights changed (a reloaded draft head), so the next rounds measure it afresh, drafting in full
        until they have, instead of judging the new drafter by the old one's record."""
        with self._lock:
            for entry in [entry for entry in self._survival if entry[0] == drafter]:
                del self._survival[entry]
            self._keys.pop(drafter, None)
            self._draft_seconds.pop(drafter, None)
            self._undrafted.pop(drafter, None)

    def _prefix(self, offer: RowOffer, length: int) -> list[float]:
        """P(first i kept), i = 1..length, for one row (call with the lock held)."""
        survival = self._survival.get((offer.drafter, offer.key)) or _Survival()
        own = offer.own
        out, p = [], 1.0
        for i in range(length):
            rate = survival.rate(i)
            if own is not None:
                trials, kept = own.tallies(i)
                rate = (kept + ROW_PRIOR_WEIGHT * rate) / (trials + ROW_PRIOR_WEIGHT)
            p *= rate
            out.append(p)
        return out

    def observe(self, drafter: str, key: int, drafted: int, kept: int) -> None:
        if drafted == 0:
            return
        with self._lock:
            self._survival.setdefault((drafter, key), _Survival()).observe(drafted, kept, self.decay)
