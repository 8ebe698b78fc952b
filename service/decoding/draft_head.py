"""A recurrent draft head on the target's final hidden state: the trained drafter for the embedded model.

Design (argued with measurements in docs/drafters.md):
- Like Apple's ReDrafter (Cheng et al., 2024, arXiv 2403.09919), the drafter is a small recurrent network
  that starts from the target's own final hidden state h (the input of its LM head) at the position that
  chose the round's last token, and unrolls one drafted position per draft token (`advance`):

      state_0 = h
      state_j = state_{j-1} + Mix(norm(state_{j-1}), norm(embed(token_{j-1})))      (+ MLP blocks)
      draft_j = argmax  norm_out(state_j) . lm_head[draft_vocab]

  It has no attention and no KV cache of its own, so it needs no rollback at all: every round starts again
  from the target's hidden state, which already summarises the whole context. In a batch, all rows draft
  together as one [rows, hidden] matmul per draft position.
- The token embeddings and the LM head are the target's own (frozen, never copied into the head's file).
- The LM head is cut to a frequency-ranked draft vocabulary (as in FR-Spec, Zhao et al. 2025, and
  EAGLE-3's draft vocabulary): the 49k-row vocabulary projection would cost more than the rest of the head;
  the draft vocabulary covers the tokens the target actually writes (coverage in the model card).

The head is trained by `python -m training` (self-distillation on the target's own answers) and ships as
safetensors + config.json in `draft_heads/`; nothing here is CPU-specific.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from service.decoding.types import DecodingError

EMBEDDED_HEAD_DIR = Path(__file__).resolve().parent / "draft_heads" / "smollm2-135m-instruct"


@dataclass(frozen=True)
class DraftHeadConfig:
    hidden_size: int  # the target's
    inner_size: int
    num_blocks: int  # the mixing block plus (num_blocks - 1) MLP blocks
    draft_vocab_size: int
    target_vocab_hash: str  # `models.vocabulary_hash` of the target the head was trained for
    target_name: str
    rms_norm_eps: float = 1e-5
    # EAGLE-3's fusion (arXiv 2503.01840): decoder layers whose outputs join the final hidden state as the
    # head's input, state_0 = h + Fuse([norm(f_low); norm(f_mid); norm(h)]); () = the final state alone
    feature_layers: tuple[int, ...] = ()
    # Temperature scaling of the head's confidence (fitted on held-out answers after training): the stop
    # rule multiplies top probabilities, so they must mean what they say on text the head never saw
    confidence_temperature: float = 1.0


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class _Block(nn.Module):
    def __init__(self, inputs: int, inner: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(inputs, inner)
        self.down = nn.Linear(inner, hidden)
        nn.init.zeros_(self.down.weight)  # every block starts as the identity on the state
        nn.init.zeros_(self.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.up(x)))


class RecurrentDraftHead(nn.Module):
    """The head's own weights plus the target's embeddings and LM-head rows, bound with `bind()`."""

    def __init__(self, config: DraftHeadConfig, draft_vocab: torch.Tensor) -> None:
        super().__init__()
        if draft_vocab.shape != (config.draft_vocab_size,):
            raise DecodingError("draft vocabulary size does not match the head's config")
        self.config = config
        d, eps = config.hidden_size, config.rms_norm_eps
        # draft vocabulary index -> target token id
        self.register_buffer("draft_vocab", draft_vocab.long().clone())
        self.state_norm = _RMSNorm(d, eps)
        self.token_norm = _RMSNorm(d, eps)
        self.mix = _Block(2 * d, config.inner_size, d)
        self.mlps = nn.ModuleList(_Block(d, config.inner_size, d) for _ in range(config.num_blocks - 1))
        self.mlp_norms = nn.ModuleList(_RMSNorm(d, eps) for _ in range(config.num_blocks - 1))
        self.out_norm = _RMSNorm(d, eps)
        inputs = len(config.feature_layers) + 1
        self.feature_norms = nn.ModuleList(_RMSNorm(d, eps) for _ in range(inputs if inputs > 1 else 0))
        self.fuse = nn.Linear(inputs * d, d) if inputs > 1 else None
        if self.fuse is not None:  # starts as the final state alone: fusion is learned on top of it
            nn.init.zeros_(self.fuse.weight)
            nn.init.zeros_(self.fuse.bias)
        # the target's, never saved with the head: [V, d] embeddings, [draft_vocab_size, d] LM-head rows
        self.embed: torch.Tensor | None = None
        self.lm_rows: torch.Tensor | None = None
        self._lm_blocks: torch.nn.Module | None = None  # a q8_head.Q8Matrix: see use_8bit_blocks

    def bind(self, embed: torch.Tensor, lm_head: torch.Tensor) -> RecurrentDraftHead:
        """Attach the target's token embeddings [V, d] and full LM-head weight [V, d] (frozen)."""
        vocab = self.draft_vocab.to(lm_head.device)
        self.embed = embed.detach()
        self.lm_rows = lm_head.detach().index_select(0, vocab).contiguous()
        return self

    @property
    def feature_size(self) -> int:
        """The width of the features a round starts from: [low, mid, ..., final] concatenated."""
        return (len(self.config.feature_layers) + 1) * self.config.hidden_size

    def initial_state(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, feature_size] (the target's at the position that chose the last token) -> state [B, d]."""
        d = self.config.hidden_size
        final = features[..., -d:]
        if self.fuse is None:
            return final
        parts = features.split(d, dim=-1)
        normed = [norm(part) for norm, part in zip(self.feature_norms, parts, strict=True)]
        return final + self.fuse(torch.cat(normed, dim=-1))

    def advance(self, state: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafted position for every row: state [B, d], token_ids [B] (target ids, the last token) ->
        (next state [B, d], logits over the draft vocabulary [B, draft_vocab_size])."""
        if self.embed is None or self.lm_rows is None:
            raise DecodingError("the draft head is not bound to its target's embeddings (bind())")
        token = self.embed[token_ids].to(state.dtype)
        state = state + self.mix(torch.cat([self.state_norm(state), self.token_norm(token)], dim=-1))
        for norm, mlp in zip(self.mlp_norms, self.mlps, strict=True):
            state = state + mlp(norm(state))
        if self._lm_blocks is not None:  # the draft vocabulary's rows from 8-bit blocks (`use_8bit_blocks`)
            return state, self._lm_blocks(self.out_norm(state)).to(state.dtype)
        logits = self.out_norm(state) @ self.lm_rows.to(state.dtype).T
        return state, logits

    def use_8bit_blocks(self) -> bool:
        """Serve the head's own layers and its draft-vocabulary rows from 8-bit blocks (the project's 8-bit
        kernel, `q8_head`): a draft position of the embedded model's head read ~36 MB of fp32 weights (2.2 ms on
        an AVX2 EPYC, a seventh of a target forward, paid for every drafted position); 8-bit blocks are a
        quarter of that. The rows of a Q8_0 LM head are found again exactly; the head's own layers are
        quantised (~0.2 % of a block's largest weight). Only where the kernel builds, on the CPU, in fp32,
        after `bind()`, and every layer's input a multiple of 32; returns whether it did. Serving only:
        training keeps the fp32 module."""
        from service.executor.q8_head import BLOCK, Q8Linear, Q8Matrix, q8_kernel, quantize_q8

        linears = [block.up for block in (self.mix, *self.mlps)] + [
            block.down for block in (self.mix, *self.mlps)
        ]
        if (
            self.lm_rows is None
            or self.lm_rows.device.type != "cpu"
            or self.lm_rows.dtype != torch.float32
            or any(layer.in_features % BLOCK for layer in linears)
            or self.lm_rows.shape[1] % BLOCK
        ):
            return False
        kernel = q8_kernel()
        if kernel is None:
            return False
        for block in (self.mix, *self.mlps):
            block.up = Q8Linear(block.up, kernel)
            block.down = Q8Linear(block.down, kernel)
        self._lm_blocks = Q8Matrix(quantize_q8(self.lm_rows), kernel)
        return True

    def full_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocabulary logits [..., V'] scattered into the target's vocabulary [..., V] (-inf elsewhere),
        for sampling: tokens outside the draft vocabulary get draft probability 0."""
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab.to(logits.device), logits)

    # ------------------------------------------------------------------ files

    def save(self, folder: Path, extra: dict | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(
            json.dumps(
                {"architecture": "RecurrentDraftHead", **asdict(self.config), **(extra or {})}, indent=1
            )
        )

    @classmethod
    def load(cls, folder: Path) -> RecurrentDraftHead:
        try:
            raw = json.loads((folder / "config.json").read_text())
            tensors = load_file(str(folder / "model.safetensors"))
        except (OSError, ValueError) as exc:
            raise DecodingError(f"cannot load draft head from {str(folder)!r}: {exc}") from exc
        fields = DraftHeadConfig.__dataclass_fields__
        values = {k: v for k, v in raw.items() if k in fields}
        values["feature_layers"] = tuple(values.get("feature_layers", ()))
        config = DraftHeadConfig(**values)
        head = cls(config, tensors["draft_vocab"])
        head.load_state_dict(tensors)
        return head.eval()
