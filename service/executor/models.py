"""Loading target and draft models with the real transformers code.

A model spec (see `paths.resolve_model_spec`) is `embedded`, a `.gguf` file, a folder, or a hub id.

GGUF weights are dequantised by transformers on load, which takes ~15 s for the embedded model, so the
converted weights are cached as safetensors under `cache_dir` keyed by the file's *content* (a sha256), so
every copy of one file (one per virtual environment, container layer or replica) shares one converted
folder; later loads read them in well under a second.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from service.decoding.types import DecodingError
from service.executor.batch_invariant import make_batch_invariant
from service.executor.cpu_kernels import default_cpu_dtype, pack_linear_layers
from service.executor.early_exit import attach_exit, read_exit_spec
from service.executor.fused_layers import executor_name, fuse_decoder_layers
from service.executor.int4_weights import gguf_is_4bit, int4_kernel, int4_supported, quantize_linear_layers
from service.executor.paths import check_gguf_header, default_cache_dir, exit_folder, resolve_model_spec
from service.executor.q8_head import head_blocks, use_q8_head

T = TypeVar("T")

log = logging.getLogger(__name__)

DTYPES = {
    "auto": "auto",
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class FinalHiddenStates:
    """The input of a model's LM head (its final hidden states) in the model's latest forward, [B, T, d]
    (T as many positions as the logits). A forward pre-hook: it copies nothing, and it is installed once per
    model however many batches read it.

    A draft head that fuses earlier layers' features (EAGLE-3) asks for them with `capture_layers`: `latest`
    is then [B, T, (len(layers) + 1) * d], the listed decoder layers' outputs followed by the final state,
    cut to the positions the LM head saw."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._final: torch.Tensor | None = None
        self._model = model
        self.layers: tuple[int, ...] = ()
        self._outputs: dict[int, torch.Tensor] = {}
        model.get_output_embeddings().register_forward_pre_hook(self._record)

    def _record(self, module: torch.nn.Module, args: tuple) -> None:
        self._final = args[0]

    def capture_layers(self, layers: tuple[int, ...]) -> None:
        """Also keep these decoder layers' outputs (idempotent; one set per model). A head that reads the final
        state alone asks for none and takes `latest`'s last `d` features, so it drafts beside (or after a
        reload from) a fused head."""
        layers = tuple(layers)
        if layers == self.layers or not layers:
            return
        if self.layers:
            raise DecodingError(
                f"this model's features are already captured from layers {self.layers}; a second draft head "
                f"asks for {layers}"
            )
        decoder_layers = self._model.get_decoder().layers
        if any(not 0 <= i < len(decoder_layers) for i in layers):
            raise DecodingError(f"feature layers {layers} outside the model's {len(decoder_layers)} layers")
        for i in layers:
            decoder_layers[i].register_forward_hook(self._layer_hook(i))
        self.layers = layers

    def _layer_hook(self, index: int):
        def hook(module: torch.nn.Module, args: tuple, output) -> None:
            self._outputs[index] = output[0] if isinstance(output, tuple) else output

        return hook

    @property
    def latest(self) -> torch.Tensor | None:
        final = self._final
        if final is None or not self.layers:
            return final
        positions = final.shape[1]  # logits_to_keep may have cut the LM head's input to the last positions
        parts = [self._outputs[i][:, -positions:].to(final.dtype) for i in self.layers]
        return torch.cat([*parts, final], dim=-1)


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and the identity the OCM namespaces patterns by."""

    name: str  # what the user asked for, or the embedded name: shown in the API as the model id
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    revision: str  # content identity: a hash of the weights' source, or the hub commit
    weights: str = "dense"  # how the linear layers hold their weights: "dense" (the dtype's) or "int4"

    @property
    def identity(self) -> str:
        """`name@revision`: what OCM namespaces, cost caches, traffic records and reports call this model."""
        return f"{self.name}@{self.revision}"

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def executor(self) -> str:
        """How its forward runs, for cost caches and reports: "fused" (`fused_layers`: C++ layers around the
        project's 4-bit kernel), "int4-kernel" (transformers' layers on that kernel), "int4-torch" (on
        torch's int4 kernel) or "eager" (dense weights)."""
        return executor_name(self.model)

    @property
    def final_hidden(self) -> FinalHiddenStates:
        """The model's final hidden states of its latest forward (what a draft head starts from)."""
        capture = self.model.__dict__.get("_csd_final_hidden")
        if capture is None:
            capture = FinalHiddenStates(self.model)
            self.model.__dict__["_csd_final_hidden"] = capture
        return capture

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head: the width of the logits (may exceed the tokenizer's length by padding)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    def memo(self, key: str, build: Callable[[], T]) -> T:
        """A value derived from this model, built on first use and kept with it: the decoding core's views of
        the vocabulary (its rescue guards' token classes, the grammar engine's tokenizer), which the executor
        keeps without knowing what they are."""
        memos = self.model.__dict__.setdefault("_csd_memos", {})
        if key not in memos:
            memos[key] = build()
        return memos[key]

    @property
    def max_context(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "max_position_embeddings", 0) or self.tokenizer.model_max_length)

    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(t) for t in source)
        return ids


def vocabulary_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of the token -> id map: token ids are only comparable within one vocabulary."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


# Hashing the 98 MB embedded file takes ~0.3 s: remember each copy's digest by its path, size and mtime, so
# a start pays it only once per copy (a changed file has a new mtime or size and is hashed again).
_DIGESTS_FILE = "gguf-digests.json"


def gguf_content_key(path: Path, cache_dir: Path) -> str:
    """The first 16 hex digits of the sha256 of a GGUF file's bytes (memoised under `cache_dir`)."""
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    index_file = cache_dir / _DIGESTS_FILE
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        index = {}
    if isinstance(index, dict) and isinstance(index.get(stamp), str):
        return index[stamp]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    key = digest.hexdigest()[:16]
    index = index if isinstance(index, dict) else {}
    index[stamp] = key
    try:  # a read-only cache folder only costs the hash again next time
        index_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = index_file.with_name(f".{_DIGESTS_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(index, indent=0))
        tmp.replace(index_file)
    except OSError as exc:
        log.debug("cannot remember the digest of %s: %s", path, exc)
    return key


def gguf_cache_folder(path: Path, cache_dir: Path) -> Path:
    """Where the converted weights of a GGUF file live: keyed by its content, wherever the file lies."""
    return cache_dir / "models" / f"{path.stem}-{gguf_content_key(path, cache_dir)}"


@contextmanager
def _quiet_load_report(quiet: bool):
    """A model cut to its first layers leaves the rest of the checkpoint unread, on purpose: transformers'
    load report would list every such weight as UNEXPECTED, a table of warnings on every start."""
    report = logging.getLogger("transformers.modeling_utils")
    level = report.level
    if quiet:
        report.setLevel(logging.ERROR)
    try:
        yield
    finally:
        report.setLevel(level)


@contextmanager
def _quiet_gguf_progress():
    """transformers' GGUF reader draws a tqdm bar of its own (`tqdm.auto`, which its progress-bar switch does
    not reach): on a server's first start it wrote an unstamped line into a log where every line carries a
    timestamp. Our own log line says the conversion runs; the bar is turned off while it does."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _convert_gguf(path: Path, cache_dir: Path) -> Path:
    """Dequantise a GGUF file once and keep it as safetensors; returns the cached folder."""
    target = gguf_cache_folder(path, cache_dir)
    if (target / "config.json").exists():
        return target
    check_gguf_header(path)
    log.info("converting %s to safetensors under %s (first load only)", path, target)
    try:
        with _quiet_gguf_progress():
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
    except Exception as exc:  # transformers raises a zoo of types for a broken file
        raise DecodingError(f"cannot load GGUF file {str(path)!r}: {exc}") from exc
    # The weights are already dequantised; drop the GGUF marker so save_pretrained accepts them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary folder and rename, so a crash mid-write never leaves a half cache behind and
    # two processes converting at once both end with a complete folder.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {"key": gguf_content_key(path, cache_dir), "converted_from": str(path.resolve())}
        (tmp / "csd_source.json").write_text(json.dumps(source))
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_model(
    spec: str,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    cache_dir: Path | None = None,
    trust_remote_code: bool = False,
    pack_cpu_weights: bool = True,
    batch_invariant: bool = True,
    weights: str = "auto",
    layers: int | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer. device: "cpu", "cuda", "cuda:1", or "auto" (device_map="auto").

    A folder holding an `exit.json` (`early_exit`, `embedded-exit` for the shipped one) is an early-exit
    draft model: its base's first layers behind a trained exit. `layers`: keep only the first `layers`
    decoder layers (what such a model is cut from).

    `dtype="auto"` on the CPU is bf16 where the CPU multiplies bf16 natively, else fp32
    (`cpu_kernels.default_cpu_dtype`); strict speculative decoding is exact in both (`batch_invariant`).
    `pack_cpu_weights`: an fp32 model on the CPU gets its linear layers packed for oneDNN (see
    `cpu_kernels`): multi-token forwards, which speculation and batching run, get much cheaper. A bf16 CPU
    model is made batch-invariant (`batch_invariant`) unless `batch_invariant=False`: only for a model whose
    outputs are compared with nothing, such as the training corpus writer (row-aligned attention gathers every
    padded row's keys per layer and forward: at 48 left-padded rows of 230-460 prompt tokens it decoded 3.4x
    slower than SDPA).

    `weights`: "int4" keeps the linear layers' weights in 4-bit groups of 32 (`int4_weights`; CPU only; the
    body in the dtype `dtype` gives: bf16 where the CPU multiplies bf16 natively, fp32
    elsewhere, where bf16 attention and norms are emulated and cost more than the 4-bit matmuls save), "dense"
    in the dtype's own format, "auto" int4 for a GGUF file whose linear layers are 4-bit
    already (the file's own precision: the Q4_1 blocks are found again exactly) on a CPU, dense elsewhere.
    With int4, an LM head that is exactly 8-bit blocks (a GGUF's Q8_0 token embeddings) reads them
    (`q8_head`: fp32 logits, a C++ kernel built on first use; the packed fp32 head without it)."""
    if dtype not in DTYPES:
        raise DecodingError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if weights not in WEIGHTS:
        raise DecodingError(f"unknown weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
    cache_dir = cache_dir or default_cache_dir()
    exit_dir = exit_folder(spec)
    if exit_dir is not None:
        exit_spec = read_exit_spec(exit_dir)
        base = load_model(
            exit_spec.base,
            dtype=dtype,
            device=device,
            cache_dir=cache_dir,
            trust_remote_code=trust_remote_code,
            pack_cpu_weights=pack_cpu_weights,
            batch_invariant=batch_invariant,
            weights=weights,
            layers=exit_spec.layers,
        )
        attach_exit(base.model, exit_spec)
        return dataclasses.replace(base, name=spec, revision=exit_spec.revision(base.revision))
    name, path, gguf_file = resolve_model_spec(spec)
    if gguf_file is not None:
        assert path is not None
        source = str(_convert_gguf(path, cache_dir))
        revision = gguf_content_key(path, cache_dir)
    else:
        source = str(path) if path is not None else spec
        revision = "local" if path is not None else "hub"
    weights = _choose_weights(weights, dtype, device, path if gguf_file is not None else None)
    torch_dtype = DTYPES[dtype]
    if torch_dtype == "auto" and device == "cpu":
        torch_dtype = auto_cpu_dtype(weights)
    # int4: quantised from the fp32 weights (exact for Q4_1), then the body cast to its dtype
    body_dtype, torch_dtype = torch_dtype, (torch.float32 if weights == "int4" else torch_dtype)
    kwargs: dict = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if layers is not None:
        kwargs["num_hidden_layers"] = layers  # the config's depth: only those layers are built and loaded
    if device == "auto":
        kwargs["device_map"] = "auto"
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        if layers is not None:  # more layers than the checkpoint holds would be initialised at random
            depth = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code).num_hidden_layers
            if not 1 <= layers <= depth:
                raise DecodingError(f"cannot keep {layers} layers of {spec!r}: it has {depth}")
        with _quiet_load_report(layers is not None):
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as exc:
        raise DecodingError(f"cannot load model {spec!r}: {exc}".splitlines()[0]) from exc
    except ValueError as exc:
        raise DecodingError(f"cannot load model {spec!r}: {exc}".splitlines()[0]) from exc
    if device != "auto":
        try:
            model = model.to(device)
        except (RuntimeError, AssertionError) as exc:
            raise DecodingError(f"cannot place model {spec!r} on device {device!r}: {exc}") from exc
    model.eval()
    # a served model never trains: its forwards track no gradients (the drafter's training reads it detached).
    # oneDNN's prepacked linear (`cpu_kernels.PackedLinear`) has no autograd kernel, and with inputs that
    # track gradients it ran through autograd's fallback, 27 ms for a one-row matmul of 0.1 ms (AVX2 dispatch)
    model.requires_grad_(False)
    if weights == "int4":
        # the LM head from the file's 8-bit blocks where it holds them (a GGUF's Q8_0 token embeddings), read
        # from the fp32 weights before the body's cast
        blocks = head_blocks(model)
        quantize_linear_layers(model)
        if body_dtype != torch.float32:  # (a cast to fp32 would widen the kernel's bf16 scales too)
            model.to(body_dtype)
        if blocks is not None:
            use_q8_head(model, blocks)
    if pack_cpu_weights:
        # fp32 only: every linear layer of a dense model, the LM head of an int4 one without 8-bit blocks
        pack_linear_layers(model)
    # strict speculative decoding's equality with plain decoding depends on it in bf16: every model that
    # serves or drafts keeps it
    if batch_invariant:
        make_batch_invariant(model)
    if weights == "int4":
        # a Llama-style 4-bit model in an fp32 body: each decoder layer as two C++ calls around a C++
        # attention (row by row: batch-invariant by construction)
        fuse_decoder_layers(model)
    if revision == "hub":
        revision = str(getattr(model.config, "_commit_hash", None) or "hub")
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, revision=revision, weights=weights)


WEIGHTS = ("auto", "dense", "int4")


def auto_cpu_dtype(weights: str) -> torch.dtype:
    """The body `--dtype auto` gives a CPU model whose weights are `weights` ("dense" or "int4"): int4 runs
    its fused fp32 layers where the project's kernel builds (`fused_layers`: 2-2.5x the one-token speed of
    either eager body), anything else the body the CPU multiplies fastest (`default_cpu_dtype`: bf16 where
    the CPU has it natively)."""
    fused = weights == "int4" and int4_kernel() is not None
    return torch.float32 if fused else default_cpu_dtype()


def _choose_weights(weights: str, dtype: str, device: str, gguf_path: Path | None) -> str:
    """What `weights` means for this load: "dense" or "int4" (see `load_model`)."""
    cpu = device == "cpu"
    if weights == "auto":
        four_bit = gguf_path is not None and gguf_is_4bit(gguf_path)
        return "int4" if four_bit and cpu and dtype == "auto" and int4_supported() else "dense"
    if weights == "int4":
        if not cpu:
            raise DecodingError(
                f"--weights int4 runs on the CPU only (device {device!r}); use --weights dense"
            )
        if not int4_supported():
            raise DecodingError("--weights int4 needs torch's CPU int4 kernels, which this torch build lacks")
        if dtype not in ("auto", "bfloat16", "bf16", "float32", "fp32"):
            raise DecodingError(
                f"--weights int4 runs a bfloat16 or float32 body; --dtype {dtype} asks for another"
            )
    return weights


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model must speak the target's token ids; refuse a mismatch with both names."""
    if vocabulary_hash(target.tokenizer) != vocabulary_hash(draft.tokenizer):
        raise DecodingError(
            f"draft model {draft.name!r} does not share the vocabulary of target model {target.name!r} "
            f"({len(draft.tokenizer)} vs {len(target.tokenizer)} tokens, or different token ids); "
            "speculative decoding needs the same tokenizer"
        )


def load_tokenizer_for_display(spec: str, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """Just the tokenizer of a model spec (for showing token ids as text); converts a GGUF if needed."""
    name, path, gguf_file = resolve_model_spec(spec)
    if gguf_file is not None:
        assert path is not None
        source = str(_convert_gguf(path, cache_dir or default_cache_dir()))
    else:
        source = str(path) if path is not None else spec
    return AutoTokenizer.from_pretrained(source)
