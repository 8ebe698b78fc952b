// One block of 32 activations quantised to 8 bits, as both kernels (int4_linear.cpp, q8_linear.cpp) and
// llama.cpp's Q8_0 / Q8_1 do: a = max|x| / 127, xq = round(x / a) (to nearest, ties to even) in -127..127.
// Also the block's fp32 sum, in one fixed order (8 lanes of 4 sequential adds, then a fixed tree) and the sum
// of xq. The AVX2 code and the portable loop give the same bits: max and integer sums are exact in any order,
// the fp32 sum follows the lanes' order in both. A scalar loop took ~1 ns an activation: a tenth of a one-row
// 4-bit matmul of the embedded model, more with rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace csd {

struct QuantisedBlock {
  float scale;  // a
  float sum;    // sum of x, in the fixed order
  int32_t qsum;  // sum of xq
};

#if defined(__AVX2__) && defined(__FMA__)

inline float block_hsum(__m256 v) {  // (s0 + s4) + (s2 + s6) + ((s1 + s5) + (s3 + s7)), as in the loop below
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// x: 32 floats; q: 32 bytes out, xq + offset (offset 0: int8; 128: uint8 for VNNI's unsigned operand)
inline QuantisedBlock quantise_block(const float* x, int8_t* q, int offset) {
  const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
               v3 = _mm256_loadu_ps(x + 24);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m256 iv = _mm256_set1_ps(inv);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, iv), kRound));
  const __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, iv), kRound));
  const __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, iv), kRound));
  const __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, iv), kRound));
  const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  // 32-bit to 8-bit: the packs interleave 128-bit lanes; a permute puts the bytes back in order
  __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (offset) bytes = _mm256_add_epi8(bytes, _mm256_set1_epi8(static_cast<char>(offset)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  const float sum = block_hsum(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v0, v1), v2), v3));
  return QuantisedBlock{amax / 127.f, sum, _mm_cvtsi128_si32(s4)};
}

#else

inline QuantisedBlock quantise_block(const float* x, int8_t* q, int offset) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t qsum = 0;
  for (int i = 0; i < 32; ++i) {
    const int v = static_cast<int>(std::nearbyint(x[i] * inv));
    qsum += v;
    q[i] = static_cast<int8_t>(static_cast<uint8_t>(v + offset));
  }
  float lanes[8];
  for (int j = 0; j < 8; ++j) lanes[j] = ((x[j] + x[8 + j]) + x[16 + j]) + x[24 + j];
  const float sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
  return QuantisedBlock{amax / 127.f, sum, qsum};
}

#endif

}  // namespace csd
