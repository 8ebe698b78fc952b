"""The trained draft head (service/decoding/draft_head.py) as a drafter: it drafts from the target's own
final hidden state, for every row of a round at once.

Per round: state = the target's hidden state at the position that chose the last committed token (the
batch hands it over from the previous verification forward), first input = that token; then one
`RecurrentDraftHead.advance` per drafted position for all rows together ([rows, hidden] matmuls). No cache,
so nothing to roll back.

A row stops drafting early when the head's own survival estimate falls below `MIN_SURVIVAL` (as EAGLE-2's
drafts grow only where the head is confident), so low-confidence drafts cost neither drafted positions of the
head nor verification width. The draft's confidence key for the draft policy is the head's probability of its
first draft token, bucketed (0: < 0.5, 1: < 0.8, 2: >= 0.8): how far a draft survives depends strongly on it,
and the policy learns a survival curve per key, as it does per n-gram length.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from service.decoding.draft_head import RecurrentDraftHead
from service.decoding.drafters.base import Draft, DraftRow, Stateless
from service.decoding.types import DecodingError
from service.decoding.verification import sampling_probs
from service.executor.models import LoadedModel, vocabulary_hash

CONFIDENCE_BUCKETS = (0.5, 0.8)
# A row stops drafting once the head's own estimate that all its draft tokens so far survive (the product of
# its top probabilities) falls below this: each further draft token costs a drafted position of the head plus
# a wider target forward (together about a tenth of a round on a CPU), so it must stand a fair chance of being
# kept.
MIN_SURVIVAL = 0.2


class HeadDrafter:
    name = "head"

    def __init__(self, target: LoadedModel, folder: Path, *, reload: bool = False) -> None:
        """`reload`: the head will replace a running one between rounds, so it must read features the running
        model already captures (hooks installed now would miss the forward in flight, and the rows hold the
        running head's features)."""
        head = RecurrentDraftHead.load(folder)
        if head.config.target_vocab_hash != vocabulary_hash(target.tokenizer):
            raise DecodingError(
                f"the draft head in {str(folder)!r} was trained for {head.config.target_name!r}, whose "
                f"vocabulary differs from the target model {target.name!r}'s"
            )
        if head.config.hidden_size != target.model.config.hidden_size:
            raise DecodingError("the draft head's hidden size does not match the target model's")
        model = target.model
        layers = tuple(head.config.feature_layers)
        captured = target.final_hidden.layers
        if reload and layers and layers != captured:
            raise DecodingError(
                f"the draft head in {str(folder)!r} fuses decoder layers {list(layers)}, which the running server "
                f"does not capture (it captures {list(captured) or 'the final state only'}): start the server "
                "with it (--draft-head) instead of reloading it"
            )
        target.final_hidden.capture_layers(layers)  # what the batch hands the head
        dtype = next(model.parameters()).dtype
        device = target.device
        head = head.to(device=device, dtype=dtype)
        self.head = head.bind(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        self.head.use_8bit_blocks()  # where the 8-bit kernel builds: a quarter of the bytes a drafted position
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.folder = folder
        self._identity = f"head:{folder.name}@{_weights_hash(folder)}"

    @property
    def identity(self) -> str:
        return self._identity

    def take_weights(self, other: HeadDrafter) -> None:
        """Draft with `other`'s head from now on (a reload, already checked by `other`'s constructor). Call it
        between rounds: the rows hold no state of the head's, so running generations draft with it next round."""
        self.head, self.vocab_size, self.folder, self._identity = (
            other.head,
            other.vocab_size,
            other.folder,
            other._identity,
        )

    def rows(self) -> HeadRows:
        return HeadRows(self)


class HeadRows(Stateless):
    def __init__(self, drafter: HeadDrafter) -> None:
        self.drafter = drafter

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        ready = [i for i, row in enumerate(rows) if row.target_hidden is not None and row.model_limit > 0]
        drafts = [Draft([]) for _ in rows]
        if not ready:
            return drafts
        head = self.drafter.head
        features = torch.stack([rows[i].target_hidden for i in ready]).to(head.lm_rows.dtype)
        state = head.initial_state(features)
        temperature = head.config.confidence_temperature
        last = torch.tensor([rows[i].committed[-1] for i in ready], device=state.device)
        greedy = all(rows[i].sampling.greedy for i in ready)
        limits = [rows[i].model_limit for i in ready]
        tokens: list[list[int]] = [[] for _ in ready]
        probs: list[list[torch.Tensor]] = [[] for _ in ready]
        first_confidence: list[float] = []
        survival = [1.0] * len(ready)  # the head's own estimate that every token drafted so far is kept
        for position in range(max(limits)):
            state, logits = head.advance(state, last)
            if greedy:  # the usual case: one argmax and one softmax for all rows
                top = logits.argmax(-1)
                top_probs = torch.softmax(logits.float() / temperature, -1).gather(-1, top[:, None])[:, 0]
                picks_t = head.draft_vocab[top]
                picks, confidences = picks_t.tolist(), top_probs.tolist()
            else:
                picks, confidences = [], []
                for j, i in enumerate(ready):
                    row = rows[i]
                    if row.sampling.greedy:
                        confidence, pick = torch.softmax(logits[j].float() / temperature, -1).max(-1)
                        token, p = int(head.draft_vocab[pick]), None
                    else:
                        full = head.full_logits(logits[j].float(), self.drafter.vocab_size)
                        p = sampling_probs(full, row.sampling.temperature, row.sampling.top_p)
                        token = int(torch.multinomial(p, 1, generator=row.generator))
                        confidence = p[token]
                    if p is not None and position < limits[j]:
                        probs[j].append(p)
                    picks.append(token)
                    confidences.append(float(confidence))
                picks_t = torch.tensor(picks, device=state.device)
            if position == 0:
                first_confidence = confidences
            for j in range(len(ready)):
                if position < limits[j]:
                    tokens[j].append(picks[j])
                    survival[j] *= confidences[j]
                    if survival[j] < MIN_SURVIVAL:  # later positions would rarely be kept: stop this row here
                        limits[j] = position + 1
            if all(position + 1 >= limit for limit in limits):
                break
            last = picks_t
        for j, i in enumerate(ready):
            key = sum(first_confidence[j] >= bound for bound in CONFIDENCE_BUCKETS)
            drafts[i] = Draft(tokens[j], torch.stack(probs[j]) if probs[j] else None, key=key)
        return drafts


def _weights_hash(folder: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with (folder / "model.safetensors").open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:12]
