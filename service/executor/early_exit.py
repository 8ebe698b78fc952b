"""An early-exit draft model: the target's own first N decoder layers, a trained exit, the target's final norm
and LM head. A real draft model that exists wherever the target does, offline, for `--drafter model`.

Self-speculation on a truncated target is LayerSkip's setting (arXiv 2404.16710); Kangaroo (arXiv
2404.18911) showed that a small trained adapter at the exit is what makes a shallow sub-network draft
well, with no second model to download. Ours is the smallest such adapter: the exit reads layer N's residual
stream h and hands the final norm h + A h (A a d x d matrix, trained, zero at the start: untrained, the exit is
plain early exit), and the final norm's scale is trained with it. It is trained (`training.exit`) on the
target's own answers in the corpus, teacher-forced, to predict the target's next token through the target's
frozen LM head. A draft model that is the target's first layers diverges from the target systematically
(what the exit cannot recover of the later layers): the recurring (draft, target) pairs that CSD's correction
memory counts.

A folder of an exit holds `exit.json` (`base`: the target's model spec; `layers`: N), `exit.safetensors`
(`adapter` [d, d], `norm` [d]) and its model card `README.md`. `load_model` loads the base with its first N
layers only (in the executor the target has: the 4-bit fused layers for a 4-bit GGUF) and calls `attach_exit`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from service.decoding.types import DecodingError

EXIT_CONFIG = "exit.json"
EXIT_WEIGHTS = "exit.safetensors"


@dataclass(frozen=True)
class ExitSpec:
    """What an exit folder says: the target it cuts, how many of its layers it keeps, and its files."""

    folder: Path
    base: str  # the target's model spec ("embedded", a GGUF file, ...)
    layers: int

    @property
    def weights(self) -> Path:
        return self.folder / EXIT_WEIGHTS

    def revision(self, base_revision: str) -> str:
        """The base's content identity and the exit's own: an OCM namespace per trained exit."""
        digest = hashlib.sha256(self.weights.read_bytes()).hexdigest()[:12]
        return f"{base_revision}+exit{self.layers}-{digest}"


def read_exit_spec(folder: Path) -> ExitSpec:
    """The exit of `folder`, or a DecodingError that says what is wrong with it."""
    try:
        config = json.loads((folder / EXIT_CONFIG).read_text(encoding="utf-8"))
        base, layers = str(config["base"]), int(config["layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DecodingError(f"{folder / EXIT_CONFIG} is not an exit's config: {exc}") from exc
    if layers < 1:
        raise DecodingError(f"{folder / EXIT_CONFIG}: layers must be >= 1, got {layers}")
    if not (folder / EXIT_WEIGHTS).is_file():
        raise DecodingError(f"exit folder {str(folder)!r} has no {EXIT_WEIGHTS}")
    # a relative base is relative to the folder (an exit trained for a GGUF file beside it)
    base_path = folder / base
    return ExitSpec(folder, str(base_path) if base_path.exists() else base, layers)


class ExitNorm(torch.nn.Module):
    """The final norm behind a trained exit: norm(h + A h). Stands in the decoder's `norm` slot, so every
    forward path of the model (the fused stack's included) goes through it."""

    def __init__(self, norm: torch.nn.Module, adapter: torch.Tensor) -> None:
        super().__init__()
        self.norm = norm
        self.adapter = torch.nn.Linear(adapter.shape[0], adapter.shape[0], bias=False)
        self.adapter.weight.data.copy_(adapter.T)  # h @ A as a linear layer: weight = A^T

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden + self.adapter(hidden))


def final_rms_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder's final RMSNorm (its `weight` and `variance_epsilon`), inside whatever wraps it (a bf16
    model's batch-invariant fp32 norm, an exit)."""
    norm = model.get_decoder().norm
    while not hasattr(norm, "weight") and hasattr(norm, "norm"):
        norm = norm.norm
    return norm


def attach_exit(model: torch.nn.Module, spec: ExitSpec) -> None:
    """Put the trained exit of `spec` in front of `model`'s final norm (`model` has the base's first
    `spec.layers` layers)."""
    decoder = model.get_decoder()
    if len(decoder.layers) != spec.layers:
        raise DecodingError(f"the exit is for {spec.layers} layers, the model has {len(decoder.layers)}")
    tensors = load_file(str(spec.weights))
    rms = final_rms_norm(model)
    hidden = rms.weight.shape[0]
    if tensors.get("adapter", torch.empty(0)).shape != (hidden, hidden) or tensors.get(
        "norm", torch.empty(0)
    ).shape != (hidden,):
        raise DecodingError(f"{spec.weights} does not hold an exit for hidden size {hidden}")
    rms.weight.data.copy_(tensors["norm"].to(rms.weight.dtype))
    # the adapter in the body's dtype: it adds to the residual stream the layers wrote in that dtype
    body = decoder.layers[0].input_layernorm.weight
    exit_norm = ExitNorm(decoder.norm, tensors["adapter"].float())
    exit_norm.adapter.to(device=body.device, dtype=body.dtype)
    decoder.norm = exit_norm.requires_grad_(False)


def save_exit(folder: Path, base: str, layers: int, adapter: torch.Tensor, norm: torch.Tensor) -> None:
    """Write an exit folder's config and weights (its model card is the trainer's to write)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EXIT_CONFIG).write_text(json.dumps({"base": base, "layers": layers}, indent=2) + "\n")
    save_file(
        {"adapter": adapter.detach().float().contiguous(), "norm": norm.detach().float().contiguous()},
        str(folder / EXIT_WEIGHTS),
    )
