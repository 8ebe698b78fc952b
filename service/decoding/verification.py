"""Verification rules: which draft tokens a target forward keeps.

Implements, on the logits of one target forward over `[last, d_1 .. d_k]`:
- strict speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
  Decoding"; Chen et al. 2023): greedy exact match, or rejection sampling that keeps the target's
  distribution exactly;
- the static lossy baseline of the CSD paper (keep a draft token whose target probability is at least
  `threshold` x the top one);
- Calibrated Speculative Decoding (arXiv 2604.13634): at a rejection, record the divergence pattern
  (draft, target top) in the Online Correction Memory, then rescue the draft token iff the pattern is recurring
  (count > lambda) and the target finds it plausible (z[d] - z[t*] >= log tau).

Which logits: the paper's z are the target's logits before temperature, and so are ours, *after* the
request's processing (penalties, logit_bias, min_tokens, the grammar's mask; `processing.LogitsProcessing`),
on purpose: they are what plain decoding chooses t* from, so a rescue judges d against the choice it would
replace, and a token the request rules out (a bias of -100, a grammar's forbidden token, at -inf) is never
kept by a rescue, which raw logits would allow. With no processing set they are the raw logits.

Paper letters -> our names: the papers' target distribution p is `target_probs`, the draft distribution q is
`draft_probs`; CSD's z_i are `target_logits[i]`, d is `draft[i]`, t* is `top`.

Beyond the paper, a rescue passes *guards* (our choice, /work/shared/CSD.md "Our guards"): the turn guard
here (never keep a draft token over a special token the target chose, such as its end of turn, nor a special
token over text) and the context fact guard of `fact_guard` (numbers, dates, names, negations).

A *rescue rule* is the only thing that differs between sd, lossy and csd: it is asked at each rejection
whether to keep the draft token anyway. Verification then goes on at the next position with the logits
already computed (they were computed with the draft token in the prefix), so one rescue can save the rest of
the draft. Under sampling we apply the same rule on the rejection branch of rejection sampling, with
t* = argmax of the same processed logits: this is our extension, the paper evaluated greedy decoding only.

Ties: t* is argmax, the lowest token id among equal logits (plain decoding takes the same), so a draft token
tied with the top is accepted when its id is the lower one and otherwise is a divergence like any other.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from service.decoding.fact_guard import CONTEXT_TOKENS
from service.decoding.types import EmittedToken, Provenance, RoundStats

# rule(draft_token, target_top, logits_row, before) -> keep the draft token? `before`: the tokens before
# the draft token (the last committed ones, then the draft kept so far in this round)
RescueRule = Callable[[int, int, torch.Tensor, Sequence[int]], bool]
# guard(before, draft_token, target_top) -> why the rescue is refused ("turn", "fact", ...), or None
RescueGuard = Callable[[Sequence[int], int, int], str | None]


class CorrectionMemory(Protocol):
    """The Online Correction Memory (OCM) as CSD needs it: count divergence patterns, read the counts.

    `ocm_store` provides implementations; the decoding core only knows this shape.
    """

    def record(self, patterns: Sequence[tuple[int, int]]) -> None: ...

    def counts(self, patterns: Sequence[tuple[int, int]]) -> list[int]: ...


@dataclass
class Verdict:
    """The tokens a round emits, in order: kept draft tokens, then one recovered / bonus token."""

    tokens: list[EmittedToken]
    round: RoundStats


# ---------------------------------------------------------------- rescue rules


def logit_gap(row: torch.Tensor, draft_token: int, top: int) -> float:
    """z[d] - z[t*] = log(p(d) / p(t*)) for any softmax over these logits: no softmax needed."""
    return float(row[draft_token] - row[top])


def turn_guard(special_ids: frozenset[int]) -> RescueGuard:
    """Refuse a rescue over a special token the target chose (its end of turn is a decision, not a
    spelling: keeping a '\\n' there runs the answer on) and a special token kept over text."""

    def guard(before: Sequence[int], draft_token: int, top: int) -> str | None:
        return "turn" if top in special_ids or draft_token in special_ids else None

    return guard


def token_set_guard(tokens: frozenset[int], reason: str = "fact") -> RescueGuard:
    """Refuse a rescue when either token is in `tokens`, whatever the context (a fixed list of ids)."""

    def guard(before: Sequence[int], draft_token: int, top: int) -> str | None:
        return reason if draft_token in tokens or top in tokens else None

    return guard


def lossy_rule(threshold: float) -> RescueRule:
    """Static lenience (the CSD paper's lossy baseline): keep d when p(d) >= threshold * p(t*)."""
    log_threshold = math.log(threshold)

    def rule(draft_token: int, top: int, row: torch.Tensor, before: Sequence[int] = ()) -> bool:
        return logit_gap(row, draft_token, top) >= log_threshold

    return rule


def calibrated_rule(
    memory: CorrectionMemory,
    lambda_: float,
    tau: float,
    guards: Sequence[RescueGuard] = (),
    refused: Counter | None = None,
) -> RescueRule:
    """CSD: record (d, t*) first, then rescue iff no guard refuses, count > lambda (OCM) and p(d)/p(t*) >= tau
    (SCG).

    `guards`: each may refuse the rescue, with its reason (`turn_guard`, `fact_guard.fact_refusal`); a refused
    rescue the gates would have passed is counted in `refused` by reason (what the guards cost)."""
    log_tau = math.log(tau)

    def rule(draft_token: int, top: int, row: torch.Tensor, before: Sequence[int] = ()) -> bool:
        pattern = (draft_token, top)
        memory.record([pattern])
        if math.isinf(lambda_):  # rescue disabled: the memory still learns
            return False
        # The semantic gate is cheaper than the count lookup on a remote-backed memory, so test it first.
        if logit_gap(row, draft_token, top) < log_tau:
            return False
        if memory.counts([pattern])[0] <= lambda_:
            return False
        for guard in guards:
            reason = guard(before, draft_token, top)
            if reason is not None:
                if refused is not None:
                    refused[reason] += 1
                return False
        return True

    return rule


def recording_rule(memory: CorrectionMemory) -> RescueRule:
    """Strict decoding that still teaches the memory (offline calibration, the paper's first phase)."""

    def rule(draft_token: int, top: int, row: torch.Tensor, before: Sequence[int] = ()) -> bool:
        memory.record([(draft_token, top)])
        return False

    return rule


def _before(committed: Sequence[int], draft: Sequence[int], i: int) -> list[int]:
    """The tokens before draft position i: the last committed ones, then the draft kept so far."""
    return [*committed[-CONTEXT_TOKENS:], *draft[:i]]


# ---------------------------------------------------------------- greedy verification


def verify_greedy(
    draft: Sequence[int],
    target_logits: torch.Tensor,
    rescue: RescueRule | None = None,
    committed: Sequence[int] = (),
) -> Verdict:
    """Greedy verification.

    draft: k draft token ids. target_logits: [k + 1, V] processed logits (see the module docstring); row i scores the token after
    `[last, d_1 .. d_i]`. Position i is accepted iff d_i == argmax(row i - 1); at a mismatch `rescue` may keep
    d_i; otherwise the target's top token is emitted (recovered) and the round ends. If all k are kept, the
    target's next token is free (bonus). committed: the sequence before the draft (the rescue's context).
    """
    k = len(draft)
    tops = target_logits.argmax(dim=-1).tolist()  # [k + 1]
    stats = RoundStats(num_draft_tokens=k)
    tokens: list[EmittedToken] = []
    for i, d in enumerate(draft):
        top = tops[i]
        if d == top:
            tokens.append(EmittedToken(d, Provenance.ACCEPTED))
            stats.num_accepted += 1
            stats.kept_per_position.append(True)
            stats.accepted_per_position.append(True)
            continue
        if rescue is not None:
            started = time.perf_counter()
            keep = rescue(d, top, target_logits[i], _before(committed, draft, i))
            stats.ocm_seconds += time.perf_counter() - started
            if keep:
                tokens.append(EmittedToken(d, Provenance.RESCUED, replaced_token_id=top))
                stats.num_rescued += 1
                stats.kept_per_position.append(True)
                stats.accepted_per_position.append(False)
                continue
        tokens.append(EmittedToken(top, Provenance.RECOVERED if k else Provenance.PLAIN))
        stats.num_recovered += 1
        stats.kept_per_position.extend([False] * (k - i))
        stats.accepted_per_position.extend([False] * (k - i))
        return Verdict(tokens, stats)
    tokens.append(EmittedToken(tops[k], Provenance.BONUS if k else Provenance.PLAIN))
    stats.num_bonus += int(k > 0)
    return Verdict(tokens, stats)


# ---------------------------------------------------------------- sampling verification


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / temperature) restricted to the top-p nucleus and renormalised. logits: [..., V]."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        # the top token always stays, also when top_p is below float32's smallest number (1e-300 -> 0.0)
        drop[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_sampling(
    draft: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    rescue: RescueRule | None = None,
    committed: Sequence[int] = (),
) -> Verdict:
    """Rejection sampling (Leviathan/Chen), lossless for `rescue=None`.

    draft_probs: [k, V'] the draft's distributions (V' may differ from V by padding), or None for a
    deterministic drafter (n-gram), which is a point mass on each draft token. Accept d_i with probability
    min(1, p(d_i) / q(d_i)); at a rejection, `rescue` may keep d_i (our extension of CSD to sampling,
    only for d_i != argmax, the divergences the memory is about), else sample from norm(max(0, p - q)).
    """
    k = len(draft)
    target_probs = sampling_probs(target_logits, temperature, top_p)  # [k + 1, V]
    stats = RoundStats(num_draft_tokens=k)
    tokens: list[EmittedToken] = []
    for i, d in enumerate(draft):
        p = target_probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        p_d = float(p[d])
        u = float(torch.rand((), generator=generator, device=p.device))
        if q_d > 0 and u < min(1.0, p_d / q_d):
            tokens.append(EmittedToken(d, Provenance.ACCEPTED))
            stats.num_accepted += 1
            stats.kept_per_position.append(True)
            stats.accepted_per_position.append(True)
            continue
        if rescue is not None:
            top = int(target_logits[i].argmax())
            if d != top:
                started = time.perf_counter()
                keep = rescue(d, top, target_logits[i], _before(committed, draft, i))
                stats.ocm_seconds += time.perf_counter() - started
                if keep:
                    tokens.append(EmittedToken(d, Provenance.RESCUED, replaced_token_id=top))
                    stats.num_rescued += 1
                    stats.kept_per_position.append(True)
                    stats.accepted_per_position.append(False)
                    continue
        tokens.append(EmittedToken(_sample(_residual(p, draft_probs, i, d), generator), Provenance.RECOVERED))
        stats.num_recovered += 1
        stats.kept_per_position.extend([False] * (k - i))
        stats.accepted_per_position.extend([False] * (k - i))
        return Verdict(tokens, stats)
    last = _sample(target_probs[k], generator)
    tokens.append(EmittedToken(last, Provenance.BONUS if k else Provenance.PLAIN))
    stats.num_bonus += int(k > 0)
    return Verdict(tokens, stats)


def _residual(p: torch.Tensor, draft_probs: torch.Tensor | None, i: int, d: int) -> torch.Tensor:
    """norm(max(0, p - q)) at position i; for a point-mass draft that is p with d removed."""
    if draft_probs is None:
        residual = p.clone()
        residual[d] = 0.0
    else:
        q = draft_probs[i].to(p.device, p.dtype)
        width = min(p.shape[-1], q.shape[-1])
        residual = p.clone()
        residual[:width] = (p[:width] - q[:width]).clamp_min(0.0)
    total = float(residual.sum())
    if total <= 0.0:  # p == q exactly: any rejection was impossible, fall back to p
        return p
    return residual / total
