// y = x W^T for a weight held as 8-bit blocks (GGUF's Q8_0: 32 int8 weights and one scale a block), with fp32
// activations and fp32 output: the LM head of a GGUF whose token embeddings are Q8_0, read as 1 byte a weight
// instead of fp32's 4. See service/decoding/q8_head.py for why and how it is used.
//
// Every output (row n, column v) is computed by the same instructions in the same order whatever the number
// of rows and threads: w = scale * q is exact in fp32 (a float16 scale times an int8), 32 lane accumulators
// take w * x block after block, and the lanes are summed in a fixed order. So a row's logits have the same
// bits alone or in a batch (what strict speculative decoding needs), and they are the dot products of the
// file's own weights to fp32 rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#define CSD_Q8_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;

inline float lane_sum(const float* lanes) {
  // a fixed pairwise order, the same for every output
  float s[16];
  for (int i = 0; i < 16; ++i) s[i] = lanes[i] + lanes[i + 16];
  for (int i = 0; i < 8; ++i) s[i] = s[i] + s[i + 8];
  for (int i = 0; i < 4; ++i) s[i] = s[i] + s[i + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// a * b + c: one fused instruction where the CPU has FMA (every x86 CPU with AVX2 but a few), else a multiply
// and an add; the same in every tile either way
inline float madd(float a, float b, float c) {
#ifdef __FMA__
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// `T` rows against one weight row: the block is decoded once for all of them. Every row gets the same
// operations as alone (lane-wise fused multiply-add, `madd`; built with -ffp-contract=off so the compiler
// fuses nothing else, differently in one tile than in another).
template <int T>
inline void dot_rows(const int8_t* __restrict qrow, const float* __restrict srow, const float* __restrict x,
                     int64_t k, int64_t groups, float* __restrict out, int64_t out_stride) {
  alignas(64) float lanes[T][kBlock] = {};
  alignas(64) float w[kBlock];
  for (int64_t g = 0; g < groups; ++g) {
    const float s = srow[g];
    const int8_t* __restrict qb = qrow + g * kBlock;
    for (int i = 0; i < kBlock; ++i) w[i] = s * static_cast<float>(qb[i]);
    for (int t = 0; t < T; ++t) {
      const float* __restrict xb = x + t * k + g * kBlock;
      for (int i = 0; i < kBlock; ++i) lanes[t][i] = madd(w[i], xb[i], lanes[t][i]);
    }
  }
  for (int t = 0; t < T; ++t) out[t * out_stride] = lane_sum(lanes[t]);
}

#if CSD_Q8_AVX2
// Up to 4 rows on AVX2, a row's lanes in two registers (16 lanes, lane i % 16 takes weight i of every block):
// a block is decoded once for the 4 rows (three instructions per 8 weights), then each row takes one fused
// multiply-add per 8 weights. The generic loop kept its lanes in memory (a store and a reload around every
// multiply-add: 5.2 ms for the embedded model's head at one row), and a layout of 32 lanes a row left room for
// only 2 rows a tile (6.2 ms at 4 rows). w = s * q exact, one fused multiply-add a lane and block, a fixed lane
// sum: every tile gives a row the same bits.
inline float lane_sum16(const float* lanes) {
  float s[8];
  for (int i = 0; i < 8; ++i) s[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) s[i] = s[i] + s[i + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

template <int T>
inline void dot_rows_avx2(const int8_t* __restrict qrow, const float* __restrict srow, const float* __restrict x,
                          int64_t k, int64_t groups, float* __restrict out, int64_t out_stride) {
  static_assert(T >= 1 && T <= 4, "up to four rows: two accumulators a row");
  __m256 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(srow[g]);
    const int8_t* qb = qrow + g * kBlock;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * j));
      const __m256 w = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t)
        acc[t][j % 2] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * k + g * kBlock + 8 * j), acc[t][j % 2]);
    }
  }
  for (int t = 0; t < T; ++t) {
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, acc[t][0]);
    _mm256_store_ps(lanes + 8, acc[t][1]);
    out[t * out_stride] = lane_sum16(lanes);
  }
}
#endif

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32 [N, K]");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous(), "q: contiguous int8 [V, K]");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == torch::kFloat32 && scales.is_contiguous(),
              "scales: contiguous fp32 [V, K / 32]");
  const int64_t n_rows = x.size(0), k = x.size(1), v_out = q.size(0), groups = k / kBlock;
  TORCH_CHECK(q.size(1) == k && k % kBlock == 0 && scales.size(0) == v_out && scales.size(1) == groups,
              "shapes do not match");
  auto out = torch::empty({n_rows, v_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();

  at::parallel_for(0, v_out, 64, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      const int8_t* qrow = qp + v * k;
      const float* srow = sp + v * groups;
      int64_t n = 0;
#if CSD_Q8_AVX2
      for (; n + 4 <= n_rows; n += 4) dot_rows_avx2<4>(qrow, srow, xp + n * k, k, groups, op + n * v_out + v, v_out);
      for (; n + 2 <= n_rows; n += 2) dot_rows_avx2<2>(qrow, srow, xp + n * k, k, groups, op + n * v_out + v, v_out);
      for (; n < n_rows; ++n) dot_rows_avx2<1>(qrow, srow, xp + n * k, k, groups, op + n * v_out + v, v_out);
#else
      for (; n + 8 <= n_rows; n += 8) dot_rows<8>(qrow, srow, xp + n * k, k, groups, op + n * v_out + v, v_out);
      for (; n + 4 <= n_rows; n += 4) dot_rows<4>(qrow, srow, xp + n * k, k, groups, op + n * v_out + v, v_out);
      for (; n + 2 <= n_rows; n += 2) dot_rows<2>(qrow, srow, xp + n * k, k, groups, op + n * v_out + v, v_out);
      for (; n < n_rows; ++n) dot_rows<1>(qrow, srow, xp + n * k, k, groups, op + n * v_out + v, v_out);
#endif
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_linear", &q8_linear, "x [N, K] fp32 times 8-bit block weights [V, K] (scales [V, K/32]): [N, V] fp32");
}
