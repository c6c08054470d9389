// Shared by the C++ kernels (row_exact.cpp, quant.cpp): the CPU check and the AVX2 horizontal sum
// whose fixed order the kernels' bit-exactness arguments rely on.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LEAPDECODE_X86 1
#endif

namespace leapdecode {

inline bool has_avx2_fma() {
#ifdef LEAPDECODE_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// AVX512F and VL: 512-bit vectors, and 32 vector registers for 256-bit code too.
inline bool has_avx512vl() {
#ifdef LEAPDECODE_X86
  return has_avx2_fma() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

// AVX512-VNNI on 256-bit vectors (`vpdpbusd ymm`: four u8 x s8 products summed into each int32
// lane in one instruction), with the AVX512 registers 16-31.
inline bool has_avx512_vnni() {
#ifdef LEAPDECODE_X86
  return has_avx512vl() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// AVX512-BF16 (`vdpbf16ps`: two bfloat16 products summed into each float lane in one instruction).
inline bool has_avx512_bf16() {
#ifdef LEAPDECODE_X86
  return has_avx512vl() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

#ifdef LEAPDECODE_X86
// The sum of eight lanes as ((v0+v4)+(v2+v6)) + ((v1+v5)+(v3+v7)).
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

// `hsum` of eight vectors at once, lane j the sum of v[j]: the same tree per vector (its halves,
// then lanes two apart, then neighbours), so each lane holds `hsum(v[j])`'s bits; 15 shuffles and
// 7 adds for eight sums where `hsum` takes 6 operations for each.
__attribute__((target("avx2,fma"))) inline __m256 hsum8(const __m256* v) {
  __m256 halves[4];  // halves[j]: [v[j] lanes 0-3 + 4-7 | v[j + 4] lanes 0-3 + 4-7]
  for (int j = 0; j < 4; ++j)
    halves[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[j], v[j + 4], 0x20), _mm256_permute2f128_ps(v[j], v[j + 4], 0x31));
  // lanes two apart: [v0: 0+2, 1+3, v1: 0+2, 1+3 | v4 .., v5 ..], and the same for v2, v3 | v6, v7
  const __m256 a = _mm256_add_ps(_mm256_shuffle_ps(halves[0], halves[1], 0x44), _mm256_shuffle_ps(halves[0], halves[1], 0xEE));
  const __m256 b = _mm256_add_ps(_mm256_shuffle_ps(halves[2], halves[3], 0x44), _mm256_shuffle_ps(halves[2], halves[3], 0xEE));
  // neighbours: [v0, v1, v2, v3 | v4, v5, v6, v7]
  return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
}
#endif

}  // namespace leapdecode
