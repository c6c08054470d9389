#include <immintrin.h>
#include <chrono>
#include <cstdio>
__attribute__((target("avx512f,avx512vnni,avx512bw"))) int main() {
  __m512i a[24]; __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(1);
  for (int i = 0; i < 24; ++i) a[i] = _mm512_setzero_si512();
  const long N = 200000000;
  auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < N; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < 24; ++i) { a[i] = _mm512_dpbusd_epi32(a[i], w, x); asm("" : "+v"(a[i])); }
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int sum = 0; for (int i = 0; i < 24; ++i) sum += _mm512_reduce_add_epi32(a[i]);
  printf("%.1f G dpbusd/s, %.0f G MAC/s one core (%d)\n", N * 24 / s / 1e9, N * 24 * 64 / s / 1e9, sum);
  // ymm
  __m256i b[12]; __m256i w2 = _mm256_set1_epi8(3), x2 = _mm256_set1_epi8(1);
  for (int i = 0; i < 12; ++i) b[i] = _mm256_setzero_si256();
  t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < N; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) { b[i] = _mm256_dpbusd_epi32(b[i], w2, x2); asm("" : "+v"(b[i])); }
  }
  s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("ymm: %.1f G dpbusd/s, %.0f G MAC/s one core\n", N * 12 / s / 1e9, N * 12 * 32 / s / 1e9);
}
