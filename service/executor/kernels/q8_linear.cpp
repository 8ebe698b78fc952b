// y = x W^T for a weight held as 8-bit blocks (GGUF's Q8_0: 32 int8 weights q and one scale s a block), fp32
// in and out: the LM head of a GGUF whose token embeddings are Q8_0 (and the draft head's layers), read as 1
// byte a weight instead of fp32's 4. See service/executor/q8_head.py for why and how it is used.
//
// The activations are quantised to 8 bits per block of 32 as llama.cpp does for its Q8_0 dot products
// (x ~ a * xq, a = max|x| / 127, xq in -127..127), so a block's product is an exact integer dot product,
// sum_k w_k x_k ~ s * a * sum_k q_k xq_k: 32 multiply-adds an instruction where fp32 did 8, and no weight
// widened to fp32. With VNNI a 4-byte dot product is one instruction (unsigned x signed: the activations go
// in offset by 128, and the 128 * sum q it adds is taken off before the first block product, from sums
// computed at packing); on AVX2 the same integers come from llama.cpp's sign trick, |q| times xq with q's
// sign, in 16-bit pairs (each at most 2 * 127 * 127: no saturation).
//
// Weight layout (made by `pack_q8` in q8_head.py): vocabulary rows (output columns) in groups of 8, and per
// group and block 256 bytes, eight runs of 32: in run i, the 4 bytes of column c (bytes 4c..4c + 3) are the
// column's block weights 4i..4i + 3. The scales s and the weight sums follow the same order, [N / 8, K / 32,
// 8] (float16 and int16). So one 32-byte run, times a row's 4 activation bytes broadcast to every lane, gives 8 columns' partial
// dot products at once, one column per 32-bit lane (the 4-bit kernel's layout, int4_linear.cpp).
//
// Every output (row r, column n) is computed by the same instructions in the same order whatever the number
// of rows and threads and whichever of the three paths runs (a row's quantisation depends on the row alone,
// integer sums are exact, the fp32 combination runs block after block in a fixed order in the column's own
// lane): a row has the same bits alone or in a batch, what strict speculative decoding and batch invariance
// need.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "blocks.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kColumns = 8;       // columns interleaved in the packed layout (one per 32-bit lane)
constexpr int64_t kGroupBytes = 256;  // one block of 8 columns
// a block's scale: float16, as Q8_0 stores it; its weights' sum (at most 32 x 127) an int16: 4 bytes a block of
// 32 weights beside its 32, where fp32 and int32 took 8
using Scale = c10::Half;
// How far ahead of its reads a tile asks for weight bytes (software prefetch): an LM head (28 MB for the
// embedded model's 49,152 x 576) streams from memory, and the hardware prefetcher alone leaves one thread well
// short of the memory's bandwidth (see int4_linear.cpp). The scales and sums (4 bytes a block of 32) as far.
constexpr int64_t kPrefetchBytes = 8192;
constexpr int64_t kPrefetchScales = kPrefetchBytes / 16;

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// A call's activations quantised per block, block-major so that a tile's rows sit side by side for each block:
// xq [K / 32, R, 32] (int8; offset by 128 as uint8 on the VNNI path), scales a [K / 32, R]. Held in buffers of
// the calling thread, reused call after call.
struct Quantised {
  const int8_t* xq;
  const float* scale;
};

Quantised quantise(const float* x, int64_t rows, int64_t k) {
  thread_local std::vector<int8_t> xq_buffer;
  thread_local std::vector<float> scale_buffer;
  const int64_t blocks = k / kBlock;
  xq_buffer.resize(static_cast<size_t>(rows * k));
  scale_buffer.resize(static_cast<size_t>(rows * blocks));
#if CSD_VNNI
  constexpr int kOffset = 128;
#else
  constexpr int kOffset = 0;
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      scale_buffer[b * rows + r] =
          csd::quantise_block(x + r * k + b * kBlock, xq_buffer.data() + (b * rows + r) * kBlock, kOffset).scale;
  return Quantised{xq_buffer.data(), scale_buffer.data()};
}

#if CSD_AVX2

// T rows (from row r0 of the `rows` quantised) times one group of 8 columns: w, s and sums at the group's start
template <int T>
inline void group_rows(const int8_t* __restrict w, const Scale* __restrict s, const int16_t* __restrict wsum,
                       const Quantised& xs, int64_t r0, int64_t rows, int64_t blocks, float* __restrict out,
                       int64_t out_stride, int64_t columns) {
#if !CSD_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* wb = w + b * kGroupBytes;
    for (int line = 0; line < 4; ++line) prefetch(wb + kPrefetchBytes + 64 * line);
    if ((b & 3) == 0) {  // 16 bytes a block of each: one line every 4 blocks
      prefetch(s + b * kColumns + kPrefetchScales);
      prefetch(wsum + b * kColumns + kPrefetchScales);
    }
    const int8_t* xb = xs.xq + (b * rows + r0) * kBlock;
#if CSD_VNNI
    // C independent chains a row (`csd::kChains`)
    constexpr int C = csd::kChains<T>;
    __m256i chains[T][C];
    // sum (xq + 128) q = sum xq q + 128 sum q: the first chain starts from -128 sum q
    const __m256i start = _mm256_slli_epi32(
        _mm256_sub_epi32(_mm256_setzero_si256(),
                         _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wsum + b * kColumns)))),
        7);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      chains[t][0] = start;
#pragma GCC unroll 8
      for (int c = 1; c < C; ++c) chains[t][c] = _mm256_setzero_si256();
    }
#else
    __m256i sums[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) sums[t] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * i));
#if !CSD_VNNI
      const __m256i magnitude = _mm256_sign_epi8(v, v);  // |q| (q is never -128)
#endif
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        int32_t x4;  // the row's activation bytes 4i..4i + 3
        std::memcpy(&x4, xb + t * kBlock + 4 * i, 4);
#if CSD_VNNI
        chains[t][i % C] = CSD_DOT_BYTES(chains[t][i % C], _mm256_set1_epi32(x4), v);
#else
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(_mm256_set1_epi32(x4), v));
        sums[t] = _mm256_add_epi32(sums[t], _mm256_madd_epi16(pairs, ones));
        csd::keep_order(sums[t]);
#endif
      }
    }
#if CSD_VNNI
    __m256i sums[T];
    csd::sum_chains(chains, sums);
#endif
    const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b * kColumns)));
    const float* a = xs.scale + b * rows + r0;
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t]), _mm256_mul_ps(sv, _mm256_set1_ps(a[t])), acc[t]);
  }
  for (int t = 0; t < T; ++t) {
    alignas(32) float y[kColumns];
    _mm256_store_ps(y, acc[t]);
    for (int64_t j = 0; j < columns; ++j) out[t * out_stride + j] = y[j];
  }
}

#if CSD_AVX512
// T rows times two neighbouring full groups of 8 columns (the second `group_bytes` / `group_scales` after the
// first) in 512-bit vectors, low half the first group, high half the second: each lane goes through the
// operations `group_rows` gives it, in the same order (the same bits), half the instructions a column
template <int T>
inline void group_pair_rows(const int8_t* __restrict w, const Scale* __restrict s, const int16_t* __restrict wsum,
                            int64_t group_bytes, int64_t group_scales, const Quantised& xs, int64_t r0, int64_t rows,
                            int64_t blocks, float* __restrict out, int64_t out_stride) {
  __m512 acc[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* wb = w + b * kGroupBytes;
    // ahead of the average of the two groups' reads: one run through both and on (int4_linear.cpp)
    for (int line = 0; line < 8; ++line) prefetch(w + 2 * b * kGroupBytes + kPrefetchBytes + 64 * line);
    if ((b & 1) == 0) {
      prefetch(s + 2 * b * kColumns + kPrefetchScales);
      prefetch(wsum + 2 * b * kColumns + kPrefetchScales);
    }
    const int8_t* xb = xs.xq + (b * rows + r0) * kBlock;
    constexpr int C = csd::kChains<T>;
    __m512i chains[T][C];
    const __m256i wsums = csd::pair_eights(wsum + b * kColumns, wsum + group_scales + b * kColumns);
    const __m512i start = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), _mm512_cvtepi16_epi32(wsums)), 7);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      chains[t][0] = start;
#pragma GCC unroll 8
      for (int c = 1; c < C; ++c) chains[t][c] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m512i v = csd::pair_runs(wb + 32 * i, wb + group_bytes + 32 * i);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        int32_t x4;
        std::memcpy(&x4, xb + t * kBlock + 4 * i, 4);
        chains[t][i % C] = _mm512_dpbusd_epi32(chains[t][i % C], _mm512_set1_epi32(x4), v);
      }
    }
    const __m512 sv = _mm512_cvtph_ps(csd::pair_eights(s + b * kColumns, s + group_scales + b * kColumns));
    const float* a = xs.scale + b * rows + r0;
    __m512i sums[T];
    csd::sum_chains(chains, sums);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t)
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t]), _mm512_mul_ps(sv, _mm512_set1_ps(a[t])), acc[t]);
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(out + t * out_stride, acc[t]);
}
#endif

#else  // portable: the same arithmetic, one column at a time

template <int T>
inline void group_rows(const int8_t* __restrict w, const Scale* __restrict s, const int16_t* __restrict wsum,
                       const Quantised& xs, int64_t r0, int64_t rows, int64_t blocks, float* __restrict out,
                       int64_t out_stride, int64_t columns) {
  (void)wsum;
  for (int t = 0; t < T; ++t) {
    for (int64_t j = 0; j < columns; ++j) {
      float y = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* wb = w + b * kGroupBytes;
        const int8_t* x = xs.xq + (b * rows + r0 + t) * kBlock;
        int32_t dot = 0;
        for (int i = 0; i < kBlock; ++i) dot += wb[32 * (i / 4) + 4 * j + i % 4] * x[i];
        y = std::fma(static_cast<float>(dot), static_cast<float>(s[b * kColumns + j]) * xs.scale[b * rows + r0 + t], y);
      }
      out[t * out_stride + j] = y;
    }
  }
}

#endif

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                        const torch::Tensor& sums, int64_t n_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32 [R, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8 && w.is_contiguous(), "w: contiguous int8 [N', K]");
  const int64_t rows = x.size(0), k = x.size(1), padded = w.size(0), blocks = k / kBlock;
  TORCH_CHECK(w.size(1) == k && k % kBlock == 0, "K must be a multiple of 32 and match the weight");
  TORCH_CHECK(padded % kColumns == 0 && n_out > padded - kColumns && n_out <= padded,
              "w's rows: the N outputs padded to a multiple of 8");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.numel() == padded * blocks,
              "scales: contiguous float16 [N', K / 32]");
  TORCH_CHECK(sums.scalar_type() == torch::kInt16 && sums.is_contiguous() && sums.numel() == padded * blocks,
              "sums: contiguous int16 [N', K / 32]");
  auto out = torch::empty({rows, n_out}, x.options());
  if (rows == 0) return out;
  const Quantised xs = quantise(x.data_ptr<float>(), rows, k);
  const int8_t* wp = w.data_ptr<int8_t>();
  const Scale* sp = scales.data_ptr<Scale>();
  const int16_t* up = sums.data_ptr<int16_t>();
  float* op = out.data_ptr<float>();
  // column groups split across threads, every column computed whole by one thread: a row's bits do not depend
  // on the thread count either
  at::parallel_for(0, padded / kColumns, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int8_t* wg = wp + g * blocks * kGroupBytes;
      const Scale* sg = sp + g * blocks * kColumns;
      const int16_t* ug = up + g * blocks * kColumns;
      const int64_t columns = std::min<int64_t>(kColumns, n_out - g * kColumns);
#if CSD_AVX512
      if (g + 1 < end && (g + 2) * kColumns <= n_out) {  // two full groups at once (same bits)
        csd::for_each_tile(rows, [&](auto size, int64_t r) {
          constexpr int T = decltype(size)::value;
          group_pair_rows<T>(wg, sg, ug, blocks * kGroupBytes, blocks * kColumns, xs, r, rows, blocks,
                             op + r * n_out + g * kColumns, n_out);
        });
        ++g;
        continue;
      }
#endif
      csd::for_each_tile(rows, [&](auto size, int64_t r) {
        constexpr int T = decltype(size)::value;
        group_rows<T>(wg, sg, ug, xs, r, rows, blocks, op + r * n_out + g * kColumns, n_out, columns);
      });
    }
  });
  return out;
}

std::string isa() {
#if CSD_AVX512
  return "avx512vnni";  // its tiles in 512-bit vectors
#else
  return csd::isa_name();
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_linear", &q8_linear,
        "x [R, K] fp32 times 8-bit block weights packed by q8_head.pack_q8 (w [N', K] int8, scales and weight "
        "sums [N', K / 32]), N' the N outputs padded to a multiple of 8: [R, N] fp32",
        pybind11::call_guard<pybind11::gil_scoped_release>());  // an LM head: its ~1 ms without the GIL
  m.def("isa", &isa, "the instruction set the kernel was built for");
}
