// What both kernels (int4_linear.cpp, q8_linear.cpp) share: the instruction set they are built for, how
// they tile rows, and one block of 32 activations quantised to 8 bits as both (and llama.cpp's Q8_0 / Q8_1)
// do: a = max|x| / 127, xq = round(x / a) (to nearest, ties to even) in -127..127, with the block's fp32 sum in
// one fixed order (8 lanes of 4 sequential adds, then a fixed tree) and the sum of xq. The AVX2 code and the
// portable loop give the same bits: max and integer sums are exact in any order, the fp32 sum follows the
// lanes' order in both. A scalar loop took ~1 ns an activation: a tenth of a one-row 4-bit matmul of the
// embedded model, more with rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CSD_AVX2 1
#include <immintrin.h>
// VNNI's one instruction for a 4-byte unsigned x signed dot product added to a 32-bit lane (AVX512-VNNI on
// 256-bit vectors: Zen 4, Ice Lake and later Xeons; AVX-VNNI: Alder Lake and later) replaces AVX2's three
// (two pairwise multiplies, one add; and one widening multiply-add a block). The kernels sum the same
// integers either way (AVX2's 16-bit pairs cannot overflow in them), so every build gives a row the same bits.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define CSD_VNNI 1
#define CSD_DOT_BYTES _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define CSD_VNNI 1
#define CSD_DOT_BYTES _mm256_dpbusd_avx_epi32
#endif
// 512-bit vectors where the CPU has AVX-512 with its byte, doubleword and VNNI instructions (Zen 4 and 5, Ice
// Lake and later Xeons): the 4-bit and 8-bit kernels' tiles then run two column groups a VNNI instruction and
// the attention a key/value group's heads together (each lane computed as the 256-bit code computes it, so the
// bits do not change)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define CSD_AVX512 1
#endif
#endif

namespace csd {

// rows that share one read of a weight block, two registers a row: 4 in AVX2's 16 vector registers, 8 where
// AVX-512VL gives 256-bit code 32 of them (the weights' decoding, shared by the tile, then costs half as much
// a row)
#if defined(__AVX512VL__)
constexpr int kMaxTile = 8;
#else
constexpr int kMaxTile = 4;
#endif

// `rows` rows as tiles, the largest first, then one tile for the rest (3 rows as one tile, not a 2-row and a
// 1-row one: each tile reads and decodes the weights once): tile(std::integral_constant<int, T>{}, first row)
template <typename Tile>
inline void for_each_tile(int64_t rows, Tile&& tile) {
  int64_t r = 0;
  for (; rows - r >= kMaxTile; r += kMaxTile) tile(std::integral_constant<int, kMaxTile>{}, r);
  if constexpr (kMaxTile > 4) {
    if (rows - r >= 4) {
      tile(std::integral_constant<int, 4>{}, r);
      r += 4;
    }
  }
  if (rows - r == 3) tile(std::integral_constant<int, 3>{}, r);
  if (rows - r == 2) tile(std::integral_constant<int, 2>{}, r);
  if (rows - r == 1) tile(std::integral_constant<int, 1>{}, r);
}

// independent chains of VNNI dot products a row of a T-row tile: one waits ~5 cycles for the instruction
// before it on the same register, so one chain a row left a 1-row call slower than AVX2's (integer sums: any
// order is exact)
template <int T>
constexpr int kChains = T >= 8 ? 1 : (T >= 4 ? 2 : (T == 3 ? 3 : 8 / T));

// An empty asm that claims to change `v`: the compiler must then add a tile row's integer products in the
// order written, one running sum a row. Integer addition is associative, so GCC's reassociation otherwise
// rebuilds each row's eight additions as a tree that starts from every product of the block at once: a 4-row
// AVX2 tile then wants ~30 vector registers of the 16 and spilled half of them to the stack each block. Kept in
// order, the tile runs without a spill: 1.2x faster at 3-16 rows (the 4-bit kernel: 2 rows 1.1x, 1 row the
// same; the 8-bit one 1.06x past 2 rows, where it is not memory-bound) on an AVX2-only EPYC (Zen 3). The
// sums are exact integers either way, so no output changes by a bit.
#if CSD_AVX2
template <typename V>
inline void keep_order(V& v) {
  asm("" : "+x"(v));
}
#endif

#if CSD_VNNI
template <int T, int C>
inline void sum_chains(const __m256i (&chains)[T][C], __m256i (&sums)[T]) {
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    sums[t] = chains[t][0];
#pragma GCC unroll 8
    for (int c = 1; c < C; ++c) sums[t] = _mm256_add_epi32(sums[t], chains[t][c]);
  }
}
#endif

#if CSD_AVX512
// what the 512-bit tiles read of two neighbouring column groups: a 32-byte run of the first (low half) and the
// second's (high half) as one vector, and 8 16-bit per-block values (float16 scales, int16 sums) of each
inline __m512i pair_runs(const void* first, const void* second) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(static_cast<const __m256i*>(first))),
                            _mm256_loadu_si256(static_cast<const __m256i*>(second)), 1);
}

inline __m256i pair_eights(const void* first, const void* second) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(static_cast<const __m128i*>(first))),
                                 _mm_loadu_si128(static_cast<const __m128i*>(second)), 1);
}

template <int T, int C>
inline void sum_chains(const __m512i (&chains)[T][C], __m512i (&sums)[T]) {
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    sums[t] = chains[t][0];
#pragma GCC unroll 8
    for (int c = 1; c < C; ++c) sums[t] = _mm512_add_epi32(sums[t], chains[t][c]);
  }
}
#endif

// the instruction set a kernel was built for, as its `isa()` says
inline std::string isa_name() {
#if CSD_VNNI && defined(__AVX512VL__)
  return "avx2+avx512vnni";
#elif CSD_VNNI
  return "avx2+avxvnni";
#elif CSD_AVX2
  return "avx2";
#else
  return "portable";
#endif
}

struct QuantisedBlock {
  float scale;  // a
  float sum;    // sum of x, in the fixed order
  int32_t qsum;  // sum of xq
};

#if CSD_AVX2

// the 8 lanes' sum in a fixed tree, (s0 + s4) + (s2 + s6) + ((s1 + s5) + (s3 + s7)), as in the portable loop
// below (the attention's dot products use it too)
inline float hsum8(__m256 v) {
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
  const float sum = hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v0, v1), v2), v3));
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
