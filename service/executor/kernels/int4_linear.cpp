// y = x W^T for a weight held as 4-bit blocks (GGUF's Q4_1: 32 weights w = d * q + m, q in 0..15), the
// activations quantised to 8 bits per block of 32 as llama.cpp does (its Q8_1), each product an exact integer
// dot product. See service/executor/int4_weights.py for why.
//
// For row r, column n and block b, with the row's block quantised as x ~ a * xq (a = max|x| / 127, xq in
// -127..127), s = the block's exact fp32 sum of x and c = 8 (s - a * sum xq):
//     sum_k x_k w_k = d * sum_k (q_k - 8) x_k + (m + 8 d) s  ~  d * (a * sum_k q_k xq_k + c) + m * s
// The rounding errors of xq meet q - 8 (centred), not q (0..15): half the error of the plain product.
//
// Weight layout (made by `pack_int4` in int4_weights.py): columns in groups of 8, and per group and block 128
// bytes, four runs of 32: in run i, the 4 bytes of column c (bytes 4c..4c + 3) hold the column's block weights
// 4i..4i + 3 in their low nibbles and 16 + 4i..16 + 4i + 3 in their high ones. The scales d and minimums m
// follow the same order, [N / 8, K / 32, 8]. So one 32-byte run, times a row's 4 activation bytes broadcast
// to every lane, gives 8 columns' partial dot products at once, one column per 32-bit lane (llama.cpp's
// repacked AVX2 GEMM layout does the same): the integer sums of a block land in one vector, and its
// conversion and scaling run once for 8 columns instead of once per column, which is what bounded the
// one-column layout past one row (2.4 instead of 5 vector instructions per block, row and column on AVX2).
//
// Every output (r, n) is computed by the same instructions in the same order whatever the number of rows and
// threads (a row's quantisation depends on the row alone, integer sums are exact, the fp32 combination runs
// block after block in a fixed order in the column's own lane), so a row has the same bits alone or in a
// batch: what strict speculative decoding and batch invariance need.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "blocks.h"

namespace {

constexpr int64_t kBlock = 32;
// a block's scale d and minimum m: float16, as GGUF's Q4_1 stores them (exact for its blocks), a third of the
// bytes a one-row forward reads besides the 4-bit weights themselves were fp32 scales and minimums
using Scale = c10::Half;
constexpr int64_t kColumns = 8;     // columns interleaved in the packed layout (one per 32-bit lane)
constexpr int64_t kGroupBytes = 128;  // one block of 8 columns
// How far ahead of its reads a tile asks for weight bytes (software prefetch). A model's weights do not fit in
// the caches (the embedded one's 4-bit layers are ~55 MB), so a one-row call streams them from memory, and
// the hardware prefetcher alone left one thread at ~17 GB/s on a Zen 5 EPYC; 8 KiB ahead: ~29 GB/s
// (1.6x). The scales and minimums (a quarter of the bytes again) are asked for as far ahead.
constexpr int64_t kPrefetchBytes = 8192;
constexpr int64_t kPrefetchScales = kPrefetchBytes / 8;  // 8 weight bytes a scale's 2 (16 weights a byte pair)

// ask for the cache line at p (no fault past a buffer's end: a prefetch is a hint)
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// A call's activations, quantised per block (see the top), block-major so that the rows of a tile sit side by
// side for each block (one pointer a tile, each row at a fixed offset): xq [K / 32, R, 32] int8; the scales a,
// sums s and corrections c [K / 32, R]. Held in buffers of the calling thread, reused call after call: an
// allocation costs about what a one-row call of a small layer does.
struct Quantised {
  const int8_t* xq;
  const float *scale, *sums, *corrections;
};

template <typename In>
Quantised quantise(const In* x, int64_t rows, int64_t k) {
  thread_local std::vector<int8_t> xq_buffer;
  thread_local std::vector<float> float_buffer;
  const int64_t blocks = k / kBlock;
  xq_buffer.resize(static_cast<size_t>(rows * k));
  float_buffer.resize(static_cast<size_t>(3 * rows * blocks));
  int8_t* xq = xq_buffer.data();
  float* scale = float_buffer.data();
  float* sums = scale + rows * blocks;
  float* corrections = sums + rows * blocks;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const In* xb = x + r * k + b * kBlock;
      float widened[kBlock];
      const float* v = reinterpret_cast<const float*>(xb);
      if constexpr (!std::is_same_v<In, float>) {
        for (int i = 0; i < kBlock; ++i) widened[i] = static_cast<float>(xb[i]);
        v = widened;
      }
      const csd::QuantisedBlock q = csd::quantise_block(v, xq + (b * rows + r) * kBlock, 0);
      scale[b * rows + r] = q.scale;
      sums[b * rows + r] = q.sum;
      corrections[b * rows + r] = 8.f * (q.sum - q.scale * static_cast<float>(q.qsum));
    }
  }
  return Quantised{xq, scale, sums, corrections};
}

#if CSD_AVX2

// T rows (from row r0 of the `rows` quantised) times one group of 8 columns: w, d and m at the group's start
template <int T, typename Out>
inline void group_rows(const uint8_t* __restrict w, const Scale* __restrict d, const Scale* __restrict m,
                       const Quantised& xs, int64_t r0, int64_t rows, int64_t blocks, Out* __restrict out,
                       int64_t out_stride) {
  const __m256i low = _mm256_set1_epi8(0x0F);
#if !CSD_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kGroupBytes;
    prefetch(wb + kPrefetchBytes);
    prefetch(wb + kPrefetchBytes + 64);
    if ((b & 3) == 0) {  // 16 bytes a block of each: one line every 4 blocks
      prefetch(d + b * kColumns + kPrefetchScales);
      prefetch(m + b * kColumns + kPrefetchScales);
    }
    const int8_t* xb = xs.xq + (b * rows + r0) * kBlock;
#if CSD_VNNI
    // per row, the block's 8 columns' integer dot products, one per 32-bit lane, in C independent chains
    constexpr int C = csd::kChains<T>;
    __m256i chains[T][C];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) chains[t][c] = _mm256_setzero_si256();
#else
    // per row, the block's 8 columns' integer dot products as 16-bit pairs: each of the 8 products summed
    // here is at most 2 * 15 * 127 in magnitude, so their sum (30,480) fits
    __m256i pairs[T];
#endif
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * i));
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        int32_t x_lo, x_hi;  // the row's activation bytes 4i..4i + 3 and 16 + 4i..16 + 4i + 3
        std::memcpy(&x_lo, xb + t * kBlock + 4 * i, 4);
        std::memcpy(&x_hi, xb + t * kBlock + 16 + 4 * i, 4);
#if CSD_VNNI
        chains[t][(2 * i) % C] = CSD_DOT_BYTES(chains[t][(2 * i) % C], lo, _mm256_set1_epi32(x_lo));
        chains[t][(2 * i + 1) % C] = CSD_DOT_BYTES(chains[t][(2 * i + 1) % C], hi, _mm256_set1_epi32(x_hi));
#else
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x_lo)),
                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x_hi)));
        pairs[t] = i == 0 ? p : _mm256_add_epi16(pairs[t], p);
        csd::keep_order(pairs[t]);
#endif
      }
    }
#if CSD_VNNI
    __m256i sums[T];
    csd::sum_chains(chains, sums);
#endif
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b * kColumns)));
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + b * kColumns)));
    const float* a = xs.scale + b * rows + r0;
    const float* s = xs.sums + b * rows + r0;
    const float* c = xs.corrections + b * rows + r0;
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
#if CSD_VNNI
      const __m256 dot = _mm256_cvtepi32_ps(sums[t]);
#else
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[t], ones));
#endif
      // d (a dot + c) + m s: three fused operations a row and block (the vector pipes that run VNNI run
      // these too, so past a few rows each one saved is ~1/12 of the kernel)
      const __m256 scaled = _mm256_fmadd_ps(dot, _mm256_set1_ps(a[t]), _mm256_set1_ps(c[t]));
      acc[t] = _mm256_fmadd_ps(dv, scaled, acc[t]);
      acc[t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(s[t]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    alignas(32) float y[kColumns];
    _mm256_store_ps(y, acc[t]);
    for (int j = 0; j < kColumns; ++j) out[t * out_stride + j] = static_cast<Out>(y[j]);
  }
}

#if CSD_AVX512
// T rows times two neighbouring groups of 8 columns (w, d and m at the first group's start; the second group
// `group_bytes` / `group_scales` after it) in 512-bit vectors: the low half of each vector is the first group's,
// the high half the second's, so each VNNI instruction, nibble mask and fp32 operation serves 16 columns, and
// a column's lane goes through the very operations, in the same order, that `group_rows` gives it: the same
// bits. Past a few rows the 256-bit tiles are bound by those instructions (~115 GMAC/s a thread on Zen 4); a
// CPU with full-width 512-bit pipes (Zen 5, Xeons) runs twice the columns in each of them.
template <int T, typename Out>
inline void group_pair_rows(const uint8_t* __restrict w, const Scale* __restrict d, const Scale* __restrict m,
                            int64_t group_bytes, int64_t group_scales, const Quantised& xs, int64_t r0, int64_t rows,
                            int64_t blocks, Out* __restrict out, int64_t out_stride) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kGroupBytes;
    // the pair's two groups lie one after the other; asking ahead of the average of the two reads streams
    // through both (and on into the next pair) as one run
    for (int line = 0; line < 4; ++line) prefetch(w + 2 * b * kGroupBytes + kPrefetchBytes + 64 * line);
    if ((b & 1) == 0) {
      prefetch(d + 2 * b * kColumns + kPrefetchScales);
      prefetch(m + 2 * b * kColumns + kPrefetchScales);
    }
    const int8_t* xb = xs.xq + (b * rows + r0) * kBlock;
    constexpr int C = csd::kChains<T>;
    __m512i chains[T][C];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) chains[t][c] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512i v = csd::pair_runs(wb + 32 * i, wb + group_bytes + 32 * i);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        int32_t x_lo, x_hi;
        std::memcpy(&x_lo, xb + t * kBlock + 4 * i, 4);
        std::memcpy(&x_hi, xb + t * kBlock + 16 + 4 * i, 4);
        chains[t][(2 * i) % C] = _mm512_dpbusd_epi32(chains[t][(2 * i) % C], lo, _mm512_set1_epi32(x_lo));
        chains[t][(2 * i + 1) % C] = _mm512_dpbusd_epi32(chains[t][(2 * i + 1) % C], hi, _mm512_set1_epi32(x_hi));
      }
    }
    __m512i sums[T];
    csd::sum_chains(chains, sums);
    const __m512 dv = _mm512_cvtph_ps(csd::pair_eights(d + b * kColumns, d + group_scales + b * kColumns));
    const __m512 mv = _mm512_cvtph_ps(csd::pair_eights(m + b * kColumns, m + group_scales + b * kColumns));
    const float* a = xs.scale + b * rows + r0;
    const float* s = xs.sums + b * rows + r0;
    const float* c = xs.corrections + b * rows + r0;
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const __m512 dot = _mm512_cvtepi32_ps(sums[t]);
      const __m512 scaled = _mm512_fmadd_ps(dot, _mm512_set1_ps(a[t]), _mm512_set1_ps(c[t]));
      acc[t] = _mm512_fmadd_ps(dv, scaled, acc[t]);
      acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(s[t]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    alignas(64) float y[2 * kColumns];
    _mm512_store_ps(y, acc[t]);
    for (int j = 0; j < 2 * kColumns; ++j) out[t * out_stride + j] = static_cast<Out>(y[j]);
  }
}
#endif

#else  // portable: the same arithmetic, one column at a time

template <int T, typename Out>
inline void group_rows(const uint8_t* __restrict w, const Scale* __restrict d, const Scale* __restrict m,
                       const Quantised& xs, int64_t r0, int64_t rows, int64_t blocks, Out* __restrict out,
                       int64_t out_stride) {
  for (int t = 0; t < T; ++t) {
    for (int64_t j = 0; j < kColumns; ++j) {
      float y = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* wb = w + b * kGroupBytes;
        const int8_t* x = xs.xq + (b * rows + r0 + t) * kBlock;
        int32_t dot = 0;
        for (int i = 0; i < 16; ++i) {  // weight i in a low nibble, 16 + i in the high one
          const uint8_t byte = wb[32 * (i / 4) + 4 * j + i % 4];
          dot += (byte & 0x0F) * x[i] + (byte >> 4) * x[16 + i];
        }
        const int64_t at = b * rows + r0 + t;
        const float dj = static_cast<float>(d[b * kColumns + j]);
        y = std::fma(dj, std::fma(static_cast<float>(dot), xs.scale[at], xs.corrections[at]), y);
        y = std::fma(static_cast<float>(m[b * kColumns + j]), xs.sums[at], y);
      }
      out[t * out_stride + j] = static_cast<Out>(y);
    }
  }
}

#endif

template <typename Out>
void run(const Quantised& xs, const uint8_t* w, const Scale* d, const Scale* m, int64_t rows, int64_t k,
         int64_t n_out, Out* out) {
  const int64_t blocks = k / kBlock;
  // column groups split across threads, every column computed whole by one thread: a row's bits do not depend
  // on the thread count either
  at::parallel_for(0, n_out / kColumns, 2, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* wg = w + g * blocks * kGroupBytes;
      const Scale* dg = d + g * blocks * kColumns;
      const Scale* mg = m + g * blocks * kColumns;
#if CSD_AVX512
      if (g + 1 < end) {  // two groups at once (same bits as one at a time)
        csd::for_each_tile(rows, [&](auto size, int64_t r) {
          constexpr int T = decltype(size)::value;
          group_pair_rows<T>(wg, dg, mg, blocks * kGroupBytes, blocks * kColumns, xs, r, rows, blocks,
                             out + r * n_out + g * kColumns, n_out);
        });
        ++g;
        continue;
      }
#endif
      csd::for_each_tile(rows, [&](auto size, int64_t r) {
        constexpr int T = decltype(size)::value;
        group_rows<T>(wg, dg, mg, xs, r, rows, blocks, out + r * n_out + g * kColumns, n_out);
      });
    }
  });
}

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& d,
                          const torch::Tensor& m) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x: contiguous fp32 or bf16 [R, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w: contiguous uint8 [N, K / 2]");
  TORCH_CHECK(d.scalar_type() == torch::kHalf && d.is_contiguous() && m.scalar_type() == torch::kHalf &&
                  m.is_contiguous(),
              "d, m: contiguous float16 [N, K / 32]");
  const int64_t rows = x.size(0), k = x.size(1), n_out = w.size(0);
  TORCH_CHECK(k % kBlock == 0 && w.size(1) == k / 2, "K must be a multiple of 32 and match the weight");
  TORCH_CHECK(n_out % kColumns == 0, "N must be a multiple of 8");
  TORCH_CHECK(d.numel() == n_out * (k / kBlock) && m.numel() == n_out * (k / kBlock), "d, m: [N, K / 32]");
  auto out = torch::empty({rows, n_out}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const Scale* dp = d.data_ptr<Scale>();
  const Scale* mp = m.data_ptr<Scale>();
  if (x.scalar_type() == torch::kFloat32) {
    run(quantise(x.data_ptr<float>(), rows, k), wp, dp, mp, rows, k, n_out, out.data_ptr<float>());
  } else {
    run(quantise(x.data_ptr<c10::BFloat16>(), rows, k), wp, dp, mp, rows, k, n_out, out.data_ptr<c10::BFloat16>());
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// A Llama-style decoder layer's two halves around its attention, each one call (fp32 activations): the eager
// layer spends more time dispatching its ~80 small operators than multiplying (see fused_layers.py). Every
// step works row by row, so a row's bits do not depend on the rows beside it, as in `int4_linear`.

// one 4-bit linear layer's buffers, as Int4Linear holds them
struct Int4Weight {
  const uint8_t* w;
  const Scale *d, *m;
  int64_t n_out;
};

Int4Weight int4_weight(const torch::Tensor& w, const torch::Tensor& d, const torch::Tensor& m, int64_t k) {
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2 && w.size(1) == k / 2,
              "a 4-bit weight [N, K / 2] for K = ", k);
  TORCH_CHECK(d.scalar_type() == torch::kHalf && d.is_contiguous() && m.scalar_type() == torch::kHalf &&
                  m.is_contiguous() && d.numel() == w.size(0) * (k / kBlock) && m.numel() == d.numel(),
              "scales and mins [N, K / 32]");
  TORCH_CHECK(w.size(0) % kColumns == 0, "a 4-bit weight's N must be a multiple of 8");
  return Int4Weight{w.data_ptr<uint8_t>(), d.data_ptr<Scale>(), m.data_ptr<Scale>(), w.size(0)};
}

// out [R, N] = x [R, K] (fp32) times the weight
void matmul(const float* x, int64_t rows, int64_t k, const Int4Weight& weight, float* out) {
  run(quantise(x, rows, k), weight.w, weight.d, weight.m, rows, k, weight.n_out, out);
}

// LlamaRMSNorm in fp32: w * (x / sqrt(mean(x^2) + eps)), a row at a time in a fixed order
void rms_norm(const float* x, const float* weight, float eps, int64_t rows, int64_t h, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * h;
    float squares = 0.f;
    for (int64_t i = 0; i < h; ++i) squares += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(h) + eps);
    for (int64_t i = 0; i < h; ++i) out[r * h + i] = weight[i] * (xr[i] * inv);
  }
}

float* scratch(std::vector<float>& buffer, int64_t size) {
  buffer.resize(static_cast<size_t>(size));
  return buffer.data();
}

// The layer's first half: input norm, the fused q/k/v projection and rotary embedding. x [B, T, H] fp32,
// cos and sin [B, T, D] (the model's rotary embedding of each position); returns q [B, Hq, T, D] and k, v
// [B, Hkv, T, D], as the attention takes them.
std::vector<torch::Tensor> norm_qkv_rope(const torch::Tensor& x, const torch::Tensor& norm_weight, double eps,
                                         const torch::Tensor& w, const torch::Tensor& d, const torch::Tensor& m,
                                         const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                                         int64_t kv_heads) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32 [B, T, H]");
  const int64_t batch = x.size(0), length = x.size(1), h = x.size(2), rows = batch * length;
  TORCH_CHECK(h % kBlock == 0, "the hidden size must be a multiple of 32");
  const Int4Weight qkv = int4_weight(w, d, m, h);
  TORCH_CHECK(qkv.n_out % (heads + 2 * kv_heads) == 0, "q, k and v heads do not divide the projection");
  const int64_t dim = qkv.n_out / (heads + 2 * kv_heads), half = dim / 2;
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == rows * dim && sin.numel() == rows * dim,
              "cos, sin: contiguous fp32 [B, T, head_dim]");
  TORCH_CHECK(norm_weight.scalar_type() == torch::kFloat32 && norm_weight.numel() == h, "norm weight: fp32 [H]");
  thread_local std::vector<float> normed_buffer, projected_buffer;
  float* normed = scratch(normed_buffer, rows * h);
  float* projected = scratch(projected_buffer, rows * qkv.n_out);
  rms_norm(x.data_ptr<float>(), norm_weight.data_ptr<float>(), static_cast<float>(eps), rows, h, normed);
  matmul(normed, rows, h, qkv, projected);
  auto options = x.options();
  auto q = torch::empty({batch, heads, length, dim}, options);
  auto k = torch::empty({batch, kv_heads, length, dim}, options);
  auto v = torch::empty({batch, kv_heads, length, dim}, options);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < length; ++t) {
      const int64_t r = b * length + t;
      const float* row = projected + r * qkv.n_out;
      const float* c = cp + r * dim;
      const float* s = sp + r * dim;
      for (int64_t head = 0; head < heads + 2 * kv_heads; ++head) {
        const float* in = row + head * dim;
        float* out;
        if (head < heads) {
          out = q.data_ptr<float>() + ((b * heads + head) * length + t) * dim;
        } else if (head < heads + kv_heads) {
          out = k.data_ptr<float>() + ((b * kv_heads + head - heads) * length + t) * dim;
        } else {
          std::copy(in, in + dim, v.data_ptr<float>() + ((b * kv_heads + head - heads - kv_heads) * length + t) * dim);
          continue;
        }
        // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), as transformers' apply_rotary_pos_emb
        for (int64_t i = 0; i < dim; ++i) {
          const float rotated = i < half ? -in[i + half] : in[i - half];
          const float a = in[i] * c[i];
          const float b2 = rotated * s[i];
          out[i] = a + b2;
        }
      }
    }
  }
  return {q, k, v};
}

// exp(x) in plain float arithmetic (range reduction by ln 2, a degree-6 polynomial, the exponent set by bit
// arithmetic; ~2 ulp): loops over it vectorise, and a value gets the same bits in a vector lane as in a scalar
// tail, which libm's exp does not promise
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// a dot product of length n (a multiple of 16) in 16 lanes, each a chain of fused multiply-adds, summed in a
// fixed order: it vectorises, and gives the bits of `attend_avx2`'s two 8-lane accumulators and `hsum8`, so a
// CPU without AVX2 (or not x86) computes what the AVX2 build does
inline float dot16(const float* __restrict a, const float* __restrict b, int64_t n) {
  float lanes[16] = {};
  for (int64_t i = 0; i < n; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] = std::fma(a[i + l], b[i + l], lanes[l]);
  for (int l = 0; l < 8; ++l) lanes[l] += lanes[l + 8];
  for (int l = 0; l < 4; ++l) lanes[l] += lanes[l + 4];
  return (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
}

// y += a * x over n floats (a multiple of 16), fused as `attend_avx2` does: it vectorises (no aliasing), each
// lane alone
inline void axpy(float a, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

#if CSD_AVX2
// One query (head dim D) over its `count` keys (rows `index` of kb and vb), in order, on AVX2: the query, then
// the output, held in registers; scores in two accumulators a key, their exponentials in a loop of their own
// (it vectorises), the values summed key after key. The generic loops below kept their 16 lanes and the output
// in memory: ~100 cycles per query and key, a tenth of a width-2 forward of the embedded model.
template <int D>
void attend_avx2(const float* __restrict qv, const float* __restrict kb, const float* __restrict vb,
                 int64_t k_stride, int64_t v_stride, const int64_t* __restrict index, int64_t count, float scale,
                 float* __restrict scores, float* __restrict o) {
  constexpr int V = D / 8;
  __m256 q[V];
#pragma GCC unroll 16
  for (int j = 0; j < V; ++j) q[j] = _mm256_loadu_ps(qv + 8 * j);
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < count; ++c) {
    const float* kv = kb + index[c] * k_stride;
    __m256 a0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(kv));
    __m256 a1 = _mm256_mul_ps(q[1], _mm256_loadu_ps(kv + 8));
#pragma GCC unroll 8
    for (int j = 2; j < V; j += 2) {
      a0 = _mm256_fmadd_ps(q[j], _mm256_loadu_ps(kv + 8 * j), a0);
      a1 = _mm256_fmadd_ps(q[j + 1], _mm256_loadu_ps(kv + 8 * j + 8), a1);
    }
    scores[c] = csd::hsum8(_mm256_add_ps(a0, a1)) * scale;
    top = std::max(top, scores[c]);
  }
  for (int64_t c = 0; c < count; ++c) scores[c] = exp_approx(scores[c] - top);
  float total = 0.f;
  for (int64_t c = 0; c < count; ++c) total += scores[c];
  __m256 acc[V];
#pragma GCC unroll 16
  for (int j = 0; j < V; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < count; ++c) {
    const __m256 p = _mm256_set1_ps(scores[c]);
    const float* vv = vb + index[c] * v_stride;
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vv + 8 * j), acc[j]);
  }
  const __m256 inv = _mm256_set1_ps(count ? 1.f / total : 0.f);
#pragma GCC unroll 16
  for (int j = 0; j < V; ++j) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(acc[j], inv));
}
#endif

#if CSD_AVX512
// G queries that read the same keys in the same order (heads of one key/value group, the same position) over
// them in 512-bit vectors, each key and value row loaded once for all G. Each query gets `attend_avx2`'s bits:
// its 16 lanes hold dimensions l, l + 16, l + 32, ... in that order (a0's and a1's lanes side by side), summed
// by the same tree (high 8 lanes onto the low 8, then `hsum8`), and each output dimension adds the keys'
// weighted values in their order. Against `attend_avx2` one head at a time: half the multiply-adds' instructions
// and a third of the loads.
// `exp_approx` on 16 lanes: the same operations in the same order (no fused multiply-adds), so each lane has the
// scalar function's bits
inline __m512 exp_approx16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// 16 vectors' lane sums, as `hsum8(lo256(a) + hi256(a))` sums each: lanes l and l + 8, then l and l + 4, then
// (0 + 2) + (1 + 3); here four rounds of shuffles and adds over all 16 at once, then a permutation back to key
// order. Returns the 16 sums in a's order.
inline __m512 reduce16(const __m512 (&a)[16]) {
  __m512 v[8], w[4], x[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // [a_2i's lanes l + (l + 8) | a_2i+1's]
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)  // 128-bit lane k: key 4j + k's lanes l + (l + 4)
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
#pragma GCC unroll 2
  for (int m = 0; m < 2; ++m)  // lane k: (0 + 2, 1 + 3) of key 8m + k, then of key 8m + 4 + k
    x[m] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane k, element e: key 4e + k's (0 + 2) + (1 + 3)
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

template <int D, int G>
void attend_group_avx512(const float* const* qv, const float* __restrict kb, const float* __restrict vb,
                         int64_t k_stride, int64_t v_stride, const int64_t* __restrict index, int64_t count,
                         float scale, float* __restrict scores, int64_t scores_stride, float* const* o) {
  constexpr int V = D / 16;
  __m512 q[G][V];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) q[g][j] = _mm512_loadu_ps(qv[g] + 16 * j);
  float top[G];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) top[g] = -std::numeric_limits<float>::infinity();
  // 16 keys at a time: each key's 16-lane products as before, then the 16 sums reduced side by side in
  // vectors (`reduce16`: the same tree, so the same bits), a few shuffles a key where `hsum8` took ~8 operations
  const int64_t blocked = count & ~static_cast<int64_t>(15);
  for (int64_t c0 = 0; c0 < blocked; c0 += 16) {
    // the keys two blocks on, asked for now: at one query a cold cache's rows stream from memory
    for (int64_t c = c0 + 32; c < std::min(c0 + 48, count); ++c) {
      const char* row = reinterpret_cast<const char*>(kb + index[c] * k_stride);
      for (int line = 0; line < D * 4; line += 64) prefetch(row + line);
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      __m512 a[16];
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) {
        const float* kv = kb + index[c0 + c] * k_stride;
        a[c] = _mm512_mul_ps(q[g][0], _mm512_loadu_ps(kv));
#pragma GCC unroll 16
        for (int j = 1; j < V; ++j) a[c] = _mm512_fmadd_ps(q[g][j], _mm512_loadu_ps(kv + 16 * j), a[c]);
      }
      const __m512 sums = _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale));
      _mm512_storeu_ps(scores + g * scores_stride + c0, sums);
      top[g] = std::max(top[g], _mm512_reduce_max_ps(sums));
    }
  }
  for (int64_t c = blocked; c < count; ++c) {
    const float* kv = kb + index[c] * k_stride;
    __m512 k[V];
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) k[j] = _mm512_loadu_ps(kv + 16 * j);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(q[g][0], k[0]);
#pragma GCC unroll 16
      for (int j = 1; j < V; ++j) a = _mm512_fmadd_ps(q[g][j], k[j], a);
      const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
      const float score = csd::hsum8(halves) * scale;
      scores[g * scores_stride + c] = score;
      top[g] = std::max(top[g], score);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * scores_stride;
    const __m512 shift = _mm512_set1_ps(top[g]);
    for (int64_t c = 0; c < blocked; c += 16) _mm512_storeu_ps(sg + c, exp_approx16(_mm512_sub_ps(_mm512_loadu_ps(sg + c), shift)));
    for (int64_t c = blocked; c < count; ++c) sg[c] = exp_approx(sg[c] - top[g]);
  }
  // each head's total in key order (the bits of a plain loop), the G heads' chains side by side: one add a key
  // waits for the one before it, so a head alone was bound by the add's latency
  float total[G], inv[G];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) total[g] = 0.f;
  for (int64_t c = 0; c < count; ++c)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) total[g] += scores[g * scores_stride + c];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) inv[g] = count ? 1.f / total[g] : 0.f;
  __m512 acc[G][V];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < count; ++c) {
    const float* vv = vb + index[c] * v_stride;
    if (c + 32 < count) {  // the value row 32 keys on
      const char* row = reinterpret_cast<const char*>(vb + index[c + 32] * v_stride);
      for (int line = 0; line < D * 4; line += 64) prefetch(row + line);
    }
    __m512 v[V];
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) v[j] = _mm512_loadu_ps(vv + 16 * j);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * scores_stride + c]);
#pragma GCC unroll 16
      for (int j = 0; j < V; ++j) acc[g][j] = _mm512_fmadd_ps(p, v[j], acc[g][j]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const __m512 scale_out = _mm512_set1_ps(inv[g]);
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) _mm512_storeu_ps(o[g] + 16 * j, _mm512_mul_ps(acc[g][j], scale_out));
  }
}

// the heads of a group in chunks of at most 4 (64 dimensions) or 2 (128): their queries and accumulators in
// 32 registers
template <int D>
void attend_heads_avx512(const float* const* qv, int64_t heads, const float* kb, const float* vb, int64_t k_stride,
                         int64_t v_stride, const int64_t* index, int64_t count, float scale, float* scores,
                         int64_t scores_stride, float* const* o) {
  constexpr int kChunk = D == 64 ? 4 : 2;
  int64_t h = 0;
  for (; heads - h >= kChunk; h += kChunk)
    attend_group_avx512<D, kChunk>(qv + h, kb, vb, k_stride, v_stride, index, count, scale, scores, scores_stride, o + h);
  const int64_t rest = heads - h;
  if constexpr (kChunk == 4) {
    if (rest == 3) attend_group_avx512<D, 3>(qv + h, kb, vb, k_stride, v_stride, index, count, scale, scores, scores_stride, o + h);
    if (rest == 2) attend_group_avx512<D, 2>(qv + h, kb, vb, k_stride, v_stride, index, count, scale, scores, scores_stride, o + h);
  }
  if (rest == 1) attend_group_avx512<D, 1>(qv + h, kb, vb, k_stride, v_stride, index, count, scale, scores, scores_stride, o + h);
}
#endif

// Attention of every query over the keys it sees, in their order: a query's output depends on nothing else
// (not the batch's other rows, its padding, the holes rejected drafts leave, nor how many queries run), which
// is the batch invariance `batch_invariant.row_aligned_attention` gets by aligning keys, here by construction.
// q [B, Hq, T, D]; k, v [B, Hkv, L, D]; mask [B, 1, T, L] (additive fp32: 0 seen, the dtype's minimum not,
// or bool) or none: causal, query t sees keys up to L - T + t. Returns [B, T, Hq * D]. k and v may be views
// with any strides but a contiguous last dimension (kv_cache.GrowingLayer's views of its buffers: reading
// them in place spares the copy a contiguous cache would cost each forward).
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const std::optional<torch::Tensor>& mask, double scaling) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                  v.scalar_type() == torch::kFloat32 && q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "q, k, v: fp32 [B, heads, length, D]");
  const auto qc = q.contiguous();
  const auto kc = k.stride(3) == 1 ? k : k.contiguous();
  const auto vc = v.stride(3) == 1 ? v : v.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), length = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k.size(1), keys = k.size(2);
  TORCH_CHECK(k.size(0) == batch && v.sizes() == k.sizes() && k.size(3) == dim && heads % kv_heads == 0 &&
                  keys >= length && dim % 16 == 0,
              "q, k, v shapes do not match");
  torch::Tensor seen;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->dim() == 4 && mask->size(0) == batch && mask->size(2) == length && mask->size(3) == keys,
                "mask: [B, 1, T, L]");
    seen = mask->scalar_type() == torch::kBool ? mask->contiguous()
                                               : (*mask > (std::numeric_limits<float>::lowest() / 2)).contiguous();
  }
  const bool* seen_p = seen.defined() ? seen.data_ptr<bool>() : nullptr;
  const int64_t seen_heads = seen.defined() ? seen.size(1) : 0;
  auto out = torch::empty({batch, length, heads * dim}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t kb_stride = kc.stride(0), kh_stride = kc.stride(1), k_stride = kc.stride(2);
  const int64_t vb_stride = vc.stride(0), vh_stride = vc.stride(1), v_stride = vc.stride(2);
  float* op = out.data_ptr<float>();
  const int64_t group = heads / kv_heads;
  const float scale = static_cast<float>(scaling);
#if CSD_AVX512
  // a group's heads read the same keys when the mask has one head (or there is none): one unit of work a row,
  // group and position, its heads together (each head's bits as alone)
  if ((dim == 64 || dim == 128) && seen_heads <= 1) {
    at::parallel_for(0, batch * kv_heads * length, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(static_cast<size_t>(group * keys));
      std::vector<int64_t> index(static_cast<size_t>(keys));
      std::vector<const float*> queries(static_cast<size_t>(group));
      std::vector<float*> outputs(static_cast<size_t>(group));
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t t = unit % length, g = (unit / length) % kv_heads, b = unit / (length * kv_heads);
        int64_t count = 0;
        if (seen_p) {
          const bool* row = seen_p + (b * seen_heads * length + t) * keys;
          for (int64_t j = 0; j < keys; ++j)
            if (row[j]) index[count++] = j;
        } else {
          for (int64_t j = 0; j <= keys - length + t; ++j) index[count++] = j;
        }
        for (int64_t i = 0; i < group; ++i) {
          const int64_t h = g * group + i;
          queries[i] = qp + ((b * heads + h) * length + t) * dim;
          outputs[i] = op + (b * length + t) * heads * dim + h * dim;
        }
        const float* kb = kp + b * kb_stride + g * kh_stride;
        const float* vb = vp + b * vb_stride + g * vh_stride;
        if (dim == 64)
          attend_heads_avx512<64>(queries.data(), group, kb, vb, k_stride, v_stride, index.data(), count, scale,
                                  scores.data(), keys, outputs.data());
        else
          attend_heads_avx512<128>(queries.data(), group, kb, vb, k_stride, v_stride, index.data(), count, scale,
                                   scores.data(), keys, outputs.data());
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(keys));
    std::vector<int64_t> index(static_cast<size_t>(keys));
    std::vector<float> acc(static_cast<size_t>(dim));
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads, g = h / group;
      const float* kb = kp + b * kb_stride + g * kh_stride;
      const float* vb = vp + b * vb_stride + g * vh_stride;
      for (int64_t t = 0; t < length; ++t) {
        const float* qv = qp + ((b * heads + h) * length + t) * dim;
        int64_t count = 0;
        if (seen_p) {
          const bool* row = seen_p + ((b * seen_heads + (seen_heads > 1 ? h : 0)) * length + t) * keys;
          for (int64_t j = 0; j < keys; ++j)
            if (row[j]) index[count++] = j;
        } else {
          for (int64_t j = 0; j <= keys - length + t; ++j) index[count++] = j;
        }
        float* o = op + (b * length + t) * heads * dim + h * dim;
#if CSD_AVX2
        if (dim == 64) {
          attend_avx2<64>(qv, kb, vb, k_stride, v_stride, index.data(), count, scale, scores.data(), o);
          continue;
        }
        if (dim == 128) {
          attend_avx2<128>(qv, kb, vb, k_stride, v_stride, index.data(), count, scale, scores.data(), o);
          continue;
        }
#endif
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < count; ++c) {
          const float* kv = kb + index[c] * k_stride;
          scores[c] = dot16(qv, kv, dim) * scale;
          top = std::max(top, scores[c]);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        float total = 0.f;
        for (int64_t c = 0; c < count; ++c) {
          const float p = exp_approx(scores[c] - top);
          total += p;
          axpy(p, vb + index[c] * v_stride, acc.data(), dim);
        }
        const float inv = count ? 1.f / total : 0.f;
        for (int64_t i = 0; i < dim; ++i) o[i] = acc[i] * inv;
      }
    }
  });
  return out;
}

inline float silu(float x) { return x / (1.f + exp_approx(-x)); }

// The layer's second half: the attention's output projection and residual, then the norm, the MLP (fused
// gate and up projection, SiLU(gate) * up, down projection) and its residual. attn [B, T, Hq * D] and
// residual [B, T, H] fp32; returns the layer's output [B, T, H].
torch::Tensor output_mlp(const torch::Tensor& attn, const torch::Tensor& residual, const torch::Tensor& o_w,
                         const torch::Tensor& o_d, const torch::Tensor& o_m, const torch::Tensor& norm_weight, double eps,
                         const torch::Tensor& gu_w, const torch::Tensor& gu_d, const torch::Tensor& gu_m,
                         const torch::Tensor& down_w, const torch::Tensor& down_d, const torch::Tensor& down_m) {
  TORCH_CHECK(attn.scalar_type() == torch::kFloat32 && attn.is_contiguous() && residual.scalar_type() == torch::kFloat32 &&
                  residual.is_contiguous() && residual.dim() == 3,
              "attn, residual: contiguous fp32");
  const int64_t h = residual.size(2), rows = residual.size(0) * residual.size(1), k_attn = attn.numel() / rows;
  TORCH_CHECK(attn.numel() == rows * k_attn && k_attn % kBlock == 0, "attn: [B, T, heads * head_dim]");
  const Int4Weight o = int4_weight(o_w, o_d, o_m, k_attn);
  const Int4Weight gate_up = int4_weight(gu_w, gu_d, gu_m, h);
  TORCH_CHECK(o.n_out == h && gate_up.n_out % 2 == 0, "o: [H, heads * head_dim], gate_up: [2 I, H]");
  const int64_t inter = gate_up.n_out / 2;
  TORCH_CHECK(inter % kBlock == 0, "the intermediate size must be a multiple of 32");
  const Int4Weight down = int4_weight(down_w, down_d, down_m, inter);
  TORCH_CHECK(down.n_out == h, "down: [H, I]");
  TORCH_CHECK(norm_weight.scalar_type() == torch::kFloat32 && norm_weight.numel() == h, "norm weight: fp32 [H]");
  thread_local std::vector<float> projected_buffer, normed_buffer, gated_buffer, act_buffer;
  auto out = torch::empty_like(residual);
  float* hidden = out.data_ptr<float>();
  float* projected = scratch(projected_buffer, rows * h);
  matmul(attn.data_ptr<float>(), rows, k_attn, o, projected);
  const float* res = residual.data_ptr<float>();
  for (int64_t i = 0; i < rows * h; ++i) hidden[i] = res[i] + projected[i];
  float* normed = scratch(normed_buffer, rows * h);
  rms_norm(hidden, norm_weight.data_ptr<float>(), static_cast<float>(eps), rows, h, normed);
  float* gated = scratch(gated_buffer, rows * 2 * inter);
  matmul(normed, rows, h, gate_up, gated);
  float* act = scratch(act_buffer, rows * inter);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gated + r * 2 * inter;
    for (int64_t i = 0; i < inter; ++i) act[r * inter + i] = silu(g[i]) * g[inter + i];
  }
  matmul(act, rows, inter, down, projected);
  for (int64_t i = 0; i < rows * h; ++i) hidden[i] = hidden[i] + projected[i];
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// The decoder's layers as one call: each layer's two halves and attention as above, its new keys and values
// written straight into the cache's buffers. A layer called from Python cost ~15 us beside its kernels (the
// module call, three calls into C++, the cache's update: 0.4-0.5 ms of a 4-7 ms forward of the embedded model,
// 0.91-0.93x the time at widths 1-8 measured on a Zen 5 EPYC); here the loop over layers runs in C++. Every
// layer computes exactly what the three calls compute, so the bits are those of the per-layer path (tested).
class DecoderStack {
 public:
  // per layer: (qkv w, d, m, o w, d, m, gate_up w, d, m, down w, d, m, input norm weight, post norm weight);
  // eps: per layer (input eps, post eps)
  DecoderStack(std::vector<std::vector<torch::Tensor>> layers, std::vector<std::vector<double>> eps, int64_t heads,
               int64_t kv_heads, double scaling)
      : layers_(std::move(layers)), eps_(std::move(eps)), heads_(heads), kv_heads_(kv_heads), scaling_(scaling) {
    TORCH_CHECK(layers_.size() == eps_.size(), "one pair of norm eps a layer");
    for (size_t i = 0; i < layers_.size(); ++i)
      TORCH_CHECK(layers_[i].size() == 14 && eps_[i].size() == 2, "a layer: 12 weight buffers, 2 norms, 2 eps");
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // x [B, T, H] fp32; cos, sin [B, T, D]; mask as `attention` takes it; keys / values: per layer the cache's
  // buffer [B, Hkv, capacity, D] (contiguous) holding `held` positions, with room for T more; capture: the
  // layers whose outputs to return too. Returns the last layer's output, then the captured ones in order.
  std::vector<torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const std::optional<torch::Tensor>& mask, const std::vector<torch::Tensor>& keys,
                                     const std::vector<torch::Tensor>& values, int64_t held,
                                     const std::vector<int64_t>& capture) {
    TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(), "a key and a value buffer a layer");
    TORCH_CHECK(x.dim() == 3, "x: [B, T, H]");
    const int64_t batch = x.size(0), length = x.size(1);
    std::vector<torch::Tensor> captured;
    torch::Tensor hidden = x.contiguous();
    for (size_t i = 0; i < layers_.size(); ++i) {
      const auto& w = layers_[i];
      const auto& kb = keys[i];
      const auto& vb = values[i];
      TORCH_CHECK(kb.dim() == 4 && kb.is_contiguous() && vb.is_contiguous() && vb.sizes() == kb.sizes() &&
                      kb.scalar_type() == torch::kFloat32 && vb.scalar_type() == torch::kFloat32 &&
                      kb.size(0) == batch && kb.size(1) == kv_heads_ && kb.size(2) >= held + length,
                  "layer ", i, "'s cache buffers: contiguous fp32 [B, Hkv, capacity >= held + T, D]");
      auto qkv = norm_qkv_rope(hidden, w[12], eps_[i][0], w[0], w[1], w[2], cos, sin, heads_, kv_heads_);
      const int64_t dim = qkv[1].size(3);
      TORCH_CHECK(kb.size(3) == dim, "layer ", i, "'s cache buffers: head dim ", dim);
      const int64_t capacity = kb.size(2);
      for (int which = 1; which <= 2; ++which) {  // new keys, then values, into the buffers at `held`
        const float* src = qkv[which].data_ptr<float>();
        float* dst = (which == 1 ? kb : vb).data_ptr<float>();
        for (int64_t bh = 0; bh < batch * kv_heads_; ++bh)
          std::memcpy(dst + (bh * capacity + held) * dim, src + bh * length * dim,
                      static_cast<size_t>(length * dim) * sizeof(float));
      }
      auto out = attention(qkv[0], kb.narrow(2, 0, held + length), vb.narrow(2, 0, held + length), mask, scaling_);
      hidden = output_mlp(out, hidden, w[3], w[4], w[5], w[13], eps_[i][1], w[6], w[7], w[8], w[9], w[10], w[11]);
      if (std::find(capture.begin(), capture.end(), static_cast<int64_t>(i)) != capture.end())
        captured.push_back(hidden);
    }
    captured.insert(captured.begin(), hidden);
    return captured;
  }

 private:
  std::vector<std::vector<torch::Tensor>> layers_;
  std::vector<std::vector<double>> eps_;
  int64_t heads_, kv_heads_;
  double scaling_;
};

std::string isa() {
#if CSD_AVX512
  return "avx512vnni";  // its 4-bit tiles in 512-bit vectors
#else
  return csd::isa_name();
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear,
        "x [R, K] (fp32 or bf16) times 4-bit block weights (packed [N, K / 2], float16 scales d and mins m [N, K / 32]): "
        "[R, N] in x's dtype");
  m.def("norm_qkv_rope", &norm_qkv_rope, "a Llama layer's input norm, fused q/k/v projection and RoPE");
  m.def("attention", &attention, "attention of each query over the keys it sees, in order (fp32)");
  m.def("output_mlp", &output_mlp, "a Llama layer's output projection, residual, norm, MLP and residual");
  m.def("isa", &isa, "the instruction set the kernel was built for");
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<double>>, int64_t, int64_t,
                          double>())
      .def("__len__", &DecoderStack::size)
      // the GIL released for the call's milliseconds: the server's event loop (streaming, new requests) runs
      // beside a forward in the engine's thread; nothing inside touches a Python object
      .def("forward", &DecoderStack::forward, "every layer in turn, keys and values written into the cache buffers",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
