"""The executor: everything between a model spec and a target forward's logits, behind the model boundary.

Drafters, verification, the draft policy and batching (`service.decoding`) see a loaded model and its forward;
how that forward runs lives here, so a new executor changes none of them:

- `paths`: model specs (embedded GGUF, folder, file, hub id) and the model cache;
- `models`: loading, `--dtype` / `--weights auto`, the model's vocabulary identity;
- `int4_weights`, `q8_head`, `cpu_kernels`, `native`, `kernels/`: the GGUF's own 4-bit blocks and the 8-bit
  LM head executed by the project's C++ kernels (compiled on first use for the CPU they run on), packed fp32
  and bf16 for the rest;
- `fused_layers`: the fused decoder body (one kernel call for QKV, one for gate/up) over those weights;
- `batch_invariant`: the kernels a row's logits need to keep their bits in any batch;
- `kv_cache`, `batch_kv`: the KV layout (a cache that grows in place; rows stacked into a batch and back);
- `forward_costs`: what a forward costs by width and rows, measured at start for the draft policy;
- `threads`: how many threads a forward uses, and the governor that changes it under load.

Importing this package is free: each module imports torch when it is imported itself, and the settings and
CLI import only `paths`. Errors a user can cause are `service.decoding.types.DecodingError`, the one error
type the API maps to a 400.
"""
