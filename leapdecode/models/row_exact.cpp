// Row-exact linear layer: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// Every output is computed by the same instruction sequence whatever the number of rows M: the
// weight row is loaded once per group of rows and used for each of them, but each row keeps its
// own accumulators, its own reduction order over k and its own final horizontal sum. So row i of
// an M-row call is bit-identical to a 1-row call on that row, by construction: a verification pass
// over a draft scores each token exactly as plain decoding does. Threads split the outputs (n),
// never the reduction.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using leapdecode::has_avx2_fma;
using leapdecode::has_avx512_bf16;
using leapdecode::has_avx512vl;
#ifdef LEAPDECODE_X86
using leapdecode::hsum;
using leapdecode::hsum8;
#endif

constexpr int kRowBlock = 8;  // rows sharing one load of each weight chunk: 8 independent FMA chains
constexpr int64_t kChunkBytes = 32768;  // keys (or values) per attention chunk: 32 KB, in L1 (or just past it)
constexpr int kSharedRows = 4;  // attention rows per shared pass (AVX-512: 8 keys x 2 row pairs = 16 accumulators)
constexpr int64_t kMaxPairedDim = 512;  // the widest head whose queries `scores_rows_avx512` pairs on its stack
constexpr int64_t kTileWeightBytes = 1024 * 1024;  // a task's row tile's scores (heads x rows x keys): about L2

// Portable path: the same structure in scalar code (16 partial sums per row, fixed order).
void rows_portable(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                   int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      float part[16] = {0};
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        for (int j = 0; j < 16; ++j) part[j] += xr[k + j] * wr[k + j];
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += part[j];
      for (; k < K; ++k) s += xr[k] * wr[k];
      y[m * N + n] = bias ? s + bias[n] : s;
    }
  }
}

#ifdef LEAPDECODE_X86
// One weight row against MB rows of x; MB is a compile-time constant so the accumulators live in
// registers. Each row's chain (8 lanes over k, then `hsum`, then the tail) does not depend on MB.
template <int MB>
__attribute__((target("avx2,fma"))) inline void block_avx2(const float* x, const float* wr, float bias_n, bool has_bias,
                                                           float* y, int64_t N, int64_t K, int64_t n) {
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = _mm256_loadu_ps(wr + k);
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k), wv, acc[i]);
  }
  for (int i = 0; i < MB; ++i) {
    const float* xr = x + i * K;
    float s = hsum(acc[i]);
    for (int64_t t = k; t < K; ++t) s += xr[t] * wr[t];
    y[i * N + n] = has_bias ? s + bias_n : s;
  }
}

// TM rows of x against TN weight rows at once (a prefill chunk's rows): TM x TN accumulators in
// registers, so each load feeds more than one fma, where `block_avx2` loads a row of x per fma.
// Each (row, output) pair's chain is `block_avx2`'s exactly (8 lanes over k, `hsum`, the tail,
// the bias), so a row's bits do not depend on the tile.
template <int TM, int TN>
__attribute__((target("avx2,fma"))) inline void tile_avx2(const float* x, const float* w, const float* bias, float* y,
                                                          int64_t N, int64_t K, int64_t n) {
  __m256 acc[TM][TN];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[TM];
    for (int i = 0; i < TM; ++i) xv[i] = _mm256_loadu_ps(x + i * K + k);
    for (int j = 0; j < TN; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + (n + j) * K + k);
      for (int i = 0; i < TM; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) {
      const float* xr = x + i * K;
      const float* wr = w + (n + j) * K;
      float s = hsum(acc[i][j]);
      for (int64_t t = k; t < K; ++t) s += xr[t] * wr[t];
      y[i * N + n + j] = bias ? s + bias[n + j] : s;
    }
}

constexpr int kTileRows = 3, kTileOutputs = 4;  // 12 accumulators + 3 rows of x + 1 weight vector: 16 registers
constexpr int64_t kTileFrom = 32;  // rows from which tiles pay (prefill chunks); fewer (decoding) keep the row blocks

__attribute__((target("avx2,fma"))) void rows_avx2(const float* x, const float* w, const float* bias, float* y,
                                                   int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  if (M >= kTileFrom) {
    const int64_t tiled = M - M % kTileRows;
    for (; n0 + kTileOutputs <= n1; n0 += kTileOutputs) {
      for (int64_t m0 = 0; m0 < tiled; m0 += kTileRows) tile_avx2<kTileRows, kTileOutputs>(x + m0 * K, w, bias, y + m0 * N, N, K, n0);
      for (int64_t m0 = tiled; m0 < M; ++m0) tile_avx2<1, kTileOutputs>(x + m0 * K, w, bias, y + m0 * N, N, K, n0);
    }
  }
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    const float b = bias ? bias[n] : 0.f;
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const float* xb = x + m0 * K;
      float* yb = y + m0 * N;
      switch (std::min<int64_t>(kRowBlock, M - m0)) {
        case 1: block_avx2<1>(xb, wr, b, bias, yb, N, K, n); break;
        case 2: block_avx2<2>(xb, wr, b, bias, yb, N, K, n); break;
        case 3: block_avx2<3>(xb, wr, b, bias, yb, N, K, n); break;
        case 4: block_avx2<4>(xb, wr, b, bias, yb, N, K, n); break;
        case 5: block_avx2<5>(xb, wr, b, bias, yb, N, K, n); break;
        case 6: block_avx2<6>(xb, wr, b, bias, yb, N, K, n); break;
        case 7: block_avx2<7>(xb, wr, b, bias, yb, N, K, n); break;
        default: block_avx2<8>(xb, wr, b, bias, yb, N, K, n); break;
      }
    }
  }
}
#endif

// A bfloat16 value as float (exact: the same sign, exponent and leading mantissa bits).
inline float bf16_value(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// rows [T, D] of a bfloat16 tensor (`stride` elements apart) as float, into `buf`; returns its data
const float* widen(const uint16_t* src, int64_t stride, int64_t T, int64_t D, std::vector<float>& buf) {
  buf.resize(T * D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) buf[t * D + d] = bf16_value(src[t * stride + d]);
  return buf.data();
}

// Attention of one query row over the keys it may see. The dot products (8 lanes over the head
// dimension, then `lanes_sum`, then the tail) and the weighted sum of values (one fma per element,
// keys in cache order, from zero) run the same sequence on both paths, so the portable path gives
// the same bits; and nothing depends on how many rows the call scores. The AVX2 path computes eight
// keys' dot products side by side and keeps a 64-wide slice of the output in registers across the
// keys: independent chains for the pipelines, the same operations on every element.
inline float lanes_sum(const float* v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

float dot_portable(const float* a, const float* b, int64_t D) {
  float lane[8] = {0};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    for (int j = 0; j < 8; ++j) lane[j] = std::fma(a[d + j], b[d + j], lane[j]);
  float s = lanes_sum(lane);
  for (; d < D; ++d) s = std::fma(a[d], b[d], s);
  return s;
}

// scores[n] = scale * q . key(keys[n]) for n < count; key(j) = k + j * ks.
void scores_portable(const float* q, const float* k, int64_t ks, const int64_t* keys, int64_t count, int64_t D, float scale,
                     float* scores) {
  for (int64_t n = 0; n < count; ++n) scores[n] = dot_portable(q, k + keys[n] * ks, D) * scale;
}

// out[d] += sum over n, in order, of e[n] * value(keys[n])[d]: one fma per term (the caller starts
// `out` at zero and feeds the keys in cache order, in as many calls as it likes).
void mix_portable(float* out, const float* e, const float* v, int64_t vs, const int64_t* keys, int64_t count, int64_t D) {
  for (int64_t n = 0; n < count; ++n)
    for (int64_t d = 0; d < D; ++d) out[d] = std::fma(e[n], v[keys[n] * vs + d], out[d]);
}

// exp(x) for x <= 0, as both paths compute it: x = n ln2 + r (|r| <= ln2/2, ln2 in two parts),
// exp(r) by a degree-6 polynomial (Horner, fma), times 2^n built in the exponent bits; 0 below
// -87 (where 2^n would leave the normal range). Relative error ~2e-7.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-06f;
constexpr float kExpPoly[7] = {1.f, 1.f, 0.5f, 0.166666672f, 4.16666418e-2f, 8.33336077e-3f, 1.39698642e-3f};
constexpr float kExpFloor = -87.f;

inline float exp_portable(float x) {
  if (x < kExpFloor) return 0.f;
  const float n = std::nearbyint(x * kLog2e);
  const float r = std::fma(-n, kLn2Lo, std::fma(-n, kLn2Hi, x));
  float p = kExpPoly[6];
  for (int c = 5; c >= 0; --c) p = std::fma(p, r, kExpPoly[c]);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// The largest of w[0 .. n) (n > 0), in 16 independent lanes: a maximum is exact in any order.
float row_max(const float* w, int64_t n) {
  float lane[16];
  for (int l = 0; l < 16; ++l) lane[l] = w[0];
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) lane[l] = std::max(lane[l], w[j + l]);
  float top = lane[0];
  for (int l = 1; l < 16; ++l) top = std::max(top, lane[l]);
  for (; j < n; ++j) top = std::max(top, w[j]);
  return top;
}

// weights[j] = exp(weights[j] - top); returns their sum: 8 lanes (j mod 8), `lanes_sum`, then the tail.
float softmax_weights_portable(float* weights, int64_t count, float top) {
  float lane[8] = {0};
  int64_t j = 0;
  for (; j + 8 <= count; j += 8)
    for (int l = 0; l < 8; ++l) {
      weights[j + l] = exp_portable(weights[j + l] - top);
      lane[l] += weights[j + l];
    }
  float total = lanes_sum(lane);
  for (; j < count; ++j) {
    weights[j] = exp_portable(weights[j] - top);
    total += weights[j];
  }
  return total;
}

#ifdef LEAPDECODE_X86
__attribute__((target("avx2,fma"))) inline float finish_dot(__m256 acc, const float* a, const float* b, int64_t d, int64_t D) {
  float s = hsum(acc);
  for (; d < D; ++d) s = std::fma(a[d], b[d], s);
  return s;
}

// KB keys' dot products side by side: KB independent chains, each `dot_portable`'s sequence.
template <int KB>
__attribute__((target("avx2,fma"))) inline void scores_block(const float* q, const float* k, int64_t ks, const int64_t* keys,
                                                             int64_t D, float scale, float* scores) {
  const float* kr[KB];
  __m256 acc[KB];
  for (int b = 0; b < KB; ++b) {
    kr[b] = k + keys[b] * ks;
    acc[b] = _mm256_setzero_ps();
  }
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int b = 0; b < KB; ++b) acc[b] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[b] + d), acc[b]);
  }
  if constexpr (KB == 8) {
    if (d == D) {  // no tail: the eight sums at once (`hsum8`, `hsum`'s bits)
      _mm256_storeu_ps(scores, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
      return;
    }
  }
  for (int b = 0; b < KB; ++b) scores[b] = finish_dot(acc[b], q, kr[b], d, D) * scale;
}

// Eight keys at a time: an fma's latency is four cycles and two issue per cycle, so eight chains
// keep the pipelines full where four left them half idle.
__attribute__((target("avx2,fma"))) void scores_avx2(const float* q, const float* k, int64_t ks, const int64_t* keys,
                                                     int64_t count, int64_t D, float scale, float* scores) {
  int64_t n = 0;
  for (; n + 8 <= count; n += 8) scores_block<8>(q, k, ks, keys + n, D, scale, scores + n);
  for (; n + 4 <= count; n += 4) scores_block<4>(q, k, ks, keys + n, D, scale, scores + n);
  for (; n < count; ++n) scores_block<1>(q, k, ks, keys + n, D, scale, scores + n);
}

__attribute__((target("avx2,fma"))) float softmax_weights_avx2(float* weights, int64_t count, float top) {
  const __m256 log2e = _mm256_set1_ps(kLog2e), ln2hi = _mm256_set1_ps(kLn2Hi), ln2lo = _mm256_set1_ps(kLn2Lo);
  const __m256 floor = _mm256_set1_ps(kExpFloor), topv = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(weights + j), topv);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, ln2lo, _mm256_fnmadd_ps(n, ln2hi, x));
    __m256 p = _mm256_set1_ps(kExpPoly[6]);
    for (int c = 5; c >= 0; --c) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[c]));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), _mm256_cmp_ps(x, floor, _CMP_GE_OQ));
    _mm256_storeu_ps(weights + j, e);
    total = _mm256_add_ps(total, e);
  }
  alignas(32) float lane[8];
  _mm256_store_ps(lane, total);
  float sum = lanes_sum(lane);
  for (; j < count; ++j) {
    weights[j] = exp_portable(weights[j] - top);
    sum += weights[j];
  }
  return sum;
}

// `mix_portable`'s sums with a slice of the output held in registers while the keys stream by.
template <int W>  // vectors per slice
__attribute__((target("avx2,fma"))) inline void mix_slice(float* out, const float* e, const float* v, int64_t vs,
                                                          const int64_t* keys, int64_t count) {
  __m256 acc[W];
  for (int w = 0; w < W; ++w) acc[w] = _mm256_loadu_ps(out + 8 * w);
  for (int64_t n = 0; n < count; ++n) {
    const __m256 ev = _mm256_set1_ps(e[n]);
    const float* vr = v + keys[n] * vs;
    for (int w = 0; w < W; ++w) acc[w] = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vr + 8 * w), acc[w]);
  }
  for (int w = 0; w < W; ++w) _mm256_storeu_ps(out + 8 * w, acc[w]);
}

__attribute__((target("avx2,fma"))) void mix_avx2(float* out, const float* e, const float* v, int64_t vs, const int64_t* keys,
                                                  int64_t count, int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) mix_slice<8>(out + d, e, v + d, vs, keys, count);
  for (; d + 8 <= D; d += 8) mix_slice<1>(out + d, e, v + d, vs, keys, count);
  for (; d < D; ++d) {
    float s = out[d];
    for (int64_t n = 0; n < count; ++n) s = std::fma(e[n], v[keys[n] * vs + d], s);
    out[d] = s;
  }
}

// Several query rows of one head over the same keys (a chain's rows see the same cached prefix):
// each key's values are loaded once for all of them. Every (row, key) score and every output
// element gets exactly the single-row functions' operations in their order (an accumulator per
// (row, key) or (row, element), fed in the same order), so the bits are those of one row alone.
// 512-bit vectors: a score's 8 lanes are those of the 256-bit functions, two keys to a register
// (lanes 0-7 one key, 8-15 the next; each half summed by the same `hsum`), and an output's 16
// elements are 16 independent lanes, so each instruction does two of theirs and the bits stay.
#define LEAPDECODE_AVX512 "avx512f,avx512vl,avx2,fma"

// The 256-bit halves of a 512-bit vector, and two 256-bit vectors as one (AVX512F only).
__attribute__((target(LEAPDECODE_AVX512))) inline __m256 upper_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
__attribute__((target(LEAPDECODE_AVX512))) inline __m512 two_halves(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

// A key's 8 floats in both halves of a 512-bit vector (AVX512F's 64-bit broadcast: one load).
__attribute__((target(LEAPDECODE_AVX512))) inline __m512 both_halves(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

// R rows' scores over the same keys, two rows to a register: lanes 0-7 one row's 8 lanes of a
// key's dot product, 8-15 the next row's, each half summed by `finish_dot` (`dot_portable`'s
// sequence). The rows' queries are laid out in pairs once per call (`pairs`: [pair][d][16]), so
// each step is one broadcast load of a key and one multiply-add per pair of rows, no shuffle.
template <int R>
__attribute__((target(LEAPDECODE_AVX512))) void scores_rows_avx512(const float* const* q, const float* k, int64_t ks, const int64_t* keys,
                                                                    int64_t count, int64_t D, float scale, float* const* scores) {
  constexpr int P = (R + 1) / 2;  // pairs of rows (an odd row's pair repeats it)
  constexpr int KB = 8;  // keys side by side: P x KB accumulators
  const int64_t D8 = D - D % 8;
  alignas(64) float pairs[P][kMaxPairedDim * 2];
  for (int p = 0; p < P; ++p) {
    const float* lo = q[2 * p];
    const float* hi = q[std::min(2 * p + 1, R - 1)];
    for (int64_t d = 0; d < D8; d += 8) _mm512_store_ps(pairs[p] + 2 * d, two_halves(_mm256_loadu_ps(lo + d), _mm256_loadu_ps(hi + d)));
  }
  int64_t n = 0;
  for (; n + KB <= count; n += KB) {
    const float* kr[KB];
    __m512 acc[P][KB];
    for (int b = 0; b < KB; ++b) kr[b] = k + keys[n + b] * ks;
    for (int p = 0; p < P; ++p)
      for (int b = 0; b < KB; ++b) acc[p][b] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
      __m512 qv[P];
      for (int p = 0; p < P; ++p) qv[p] = _mm512_load_ps(pairs[p] + 2 * d);
      for (int b = 0; b < KB; ++b) {
        const __m512 kv = both_halves(kr[b] + d);
        for (int p = 0; p < P; ++p) acc[p][b] = _mm512_fmadd_ps(qv[p], kv, acc[p][b]);
      }
    }
    if (D8 == D) {  // no tail: each row's eight sums at once (`hsum8`, `hsum`'s bits)
      const __m256 sv = _mm256_set1_ps(scale);
      for (int p = 0; p < P; ++p) {
        __m256 lo[KB], hi[KB];
        for (int b = 0; b < KB; ++b) lo[b] = _mm512_castps512_ps256(acc[p][b]), hi[b] = upper_half(acc[p][b]);
        _mm256_storeu_ps(scores[2 * p] + n, _mm256_mul_ps(hsum8(lo), sv));
        if (2 * p + 1 < R) _mm256_storeu_ps(scores[2 * p + 1] + n, _mm256_mul_ps(hsum8(hi), sv));
      }
      continue;
    }
    for (int p = 0; p < P; ++p)
      for (int b = 0; b < KB; ++b) {
        scores[2 * p][n + b] = finish_dot(_mm512_castps512_ps256(acc[p][b]), q[2 * p], kr[b], D8, D) * scale;
        if (2 * p + 1 < R) scores[2 * p + 1][n + b] = finish_dot(upper_half(acc[p][b]), q[2 * p + 1], kr[b], D8, D) * scale;
      }
  }
  for (int r = 0; r < R; ++r) scores_avx2(q[r], k, ks, keys + n, count - n, D, scale, scores[r] + n);
}

template <int R>
__attribute__((target(LEAPDECODE_AVX512))) void mix_rows_avx512(float* const* out, const float* const* e, const float* v, int64_t vs,
                                                                 const int64_t* keys, int64_t count, int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < 4; ++w) acc[r][w] = _mm512_loadu_ps(out[r] + d + 16 * w);
    for (int64_t n = 0; n < count; ++n) {
      const float* vr = v + keys[n] * vs + d;
      __m512 ev[R];
      for (int r = 0; r < R; ++r) ev[r] = _mm512_set1_ps(e[r][n]);
      for (int w = 0; w < 4; ++w) {
        const __m512 vv = _mm512_loadu_ps(vr + 16 * w);
        for (int r = 0; r < R; ++r) acc[r][w] = _mm512_fmadd_ps(ev[r], vv, acc[r][w]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < 4; ++w) _mm512_storeu_ps(out[r] + d + 16 * w, acc[r][w]);
  }
  if (d < D)
    for (int r = 0; r < R; ++r) mix_avx2(out[r] + d, e[r], v + d, vs, keys, count, D - d);
}

static_assert(kSharedRows <= 4, "the shared-pass dispatch below takes up to four rows");

void scores_rows_avx512_any(int rows, const float* const* q, const float* k, int64_t ks, const int64_t* keys, int64_t count, int64_t D,
                            float scale, float* const* scores) {
  if (D > kMaxPairedDim) {  // wider heads than the paired queries' buffer: one row at a time
    for (int r = 0; r < rows; ++r) scores_avx2(q[r], k, ks, keys, count, D, scale, scores[r]);
    return;
  }
  if (rows == 4) return scores_rows_avx512<4>(q, k, ks, keys, count, D, scale, scores);
  if (rows == 3) return scores_rows_avx512<3>(q, k, ks, keys, count, D, scale, scores);
  if (rows == 2) return scores_rows_avx512<2>(q, k, ks, keys, count, D, scale, scores);
  scores_rows_avx512<1>(q, k, ks, keys, count, D, scale, scores);
}

void mix_rows_avx512_any(int rows, float* const* out, const float* const* e, const float* v, int64_t vs, const int64_t* keys, int64_t count,
                         int64_t D) {
  if (rows == 4) return mix_rows_avx512<4>(out, e, v, vs, keys, count, D);
  if (rows == 3) return mix_rows_avx512<3>(out, e, v, vs, keys, count, D);
  if (rows == 2) return mix_rows_avx512<2>(out, e, v, vs, keys, count, D);
  mix_rows_avx512<1>(out, e, v, vs, keys, count, D);
}
#endif

#ifdef LEAPDECODE_X86
// x . x with `dot_portable`'s sequence
__attribute__((target("avx2,fma"))) float sum_squares_avx2(const float* x, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 v = _mm256_loadu_ps(x + d);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  return finish_dot(acc, x, x, d, D);
}
#endif

}  // namespace

namespace {

// One attention call's work, checked and laid out (`prepare`): its Hkv * tiles tasks (a kv head and
// some of its query heads each) run by `attend_tasks`, over one parallel region of its own
// (`row_exact_attention`) or one shared with other sequences' calls (`row_exact_attentions`).
struct Attention {
  torch::Tensor q, k, v, mask, out;  // held: the pointers below read them
  bool bf16 = false;
  int64_t H = 0, Q = 0, D = 0, Hkv = 0, T = 0, group = 0, tiles = 1, per_tile = 1, chunk = 8, row_tile = 1;
  const float *qp = nullptr, *kp = nullptr, *vp = nullptr;
  const uint16_t *kb = nullptr, *vb = nullptr;
  const bool* mp = nullptr;
  float* op = nullptr;
  int64_t ks1 = 0, ks2 = 0, vs1 = 0, vs2 = 0;
  float sc = 1.f;
  decltype(&scores_portable) scores = scores_portable;  // chosen once: every path gives the same bits
  decltype(&softmax_weights_portable) softmax = softmax_weights_portable;
  decltype(&mix_portable) mix = mix_portable;
  // rows of one head sharing their keys: together where AVX512's registers allow, else one by one
  void (*scores_rows)(int, const float* const*, const float*, int64_t, const int64_t*, int64_t, int64_t, float, float* const*) = nullptr;
  void (*mix_rows)(int, float* const*, const float* const*, const float*, int64_t, const int64_t*, int64_t, int64_t) = nullptr;

  int64_t tasks() const { return Hkv * tiles; }
};

// query [1, H, Q, D]; key, value [1, Hkv, T, D] (any strides but the last, e.g. views of a longer
// cache); visible [Q, T] bool, or None: causal, the queries being the last Q positions.
Attention prepare(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                  const std::optional<torch::Tensor>& visible, double scale, bool portable) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1 && key.size(0) == 1 &&
                  value.size(0) == 1, "row_exact_attention: [1, heads, length, dim] tensors expected");
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) && key.scalar_type() == dtype && value.scalar_type() == dtype,
              "row_exact_attention: float32 or bfloat16 query, key and value expected");
  Attention a;
  a.bf16 = dtype == torch::kBFloat16;
  a.H = query.size(1), a.Q = query.size(2), a.D = query.size(3), a.Hkv = key.size(1), a.T = key.size(2);
  const int64_t H = a.H, Q = a.Q, D = a.D, Hkv = a.Hkv, T = a.T;
  TORCH_CHECK(key.size(3) == D && value.size(1) == Hkv && value.size(2) == T && value.size(3) == D && Hkv > 0 && H % Hkv == 0,
              "row_exact_attention: key/value shapes do not fit the query");
  TORCH_CHECK(T >= Q, "row_exact_attention: fewer keys than queries");
  // bfloat16: every product and sum in float, as a one-token pass computes them too (the same
  // call); the query is widened here, each task's keys and values below, the output rounded once
  a.q = query.to(torch::kFloat).contiguous();
  a.k = key.stride(3) == 1 ? key : key.contiguous();
  a.v = value.stride(3) == 1 ? value : value.contiguous();
  if (visible) {
    TORCH_CHECK(visible->scalar_type() == torch::kBool && visible->dim() == 2 && visible->size(0) == Q && visible->size(1) == T,
                "row_exact_attention: visible [queries, keys] bool expected");
    a.mask = visible->contiguous();
    a.mp = a.mask.data_ptr<bool>();
  }
  a.out = torch::zeros({1, Q, H, D}, a.q.options());
  a.qp = a.q.data_ptr<float>();
  if (a.bf16) {
    a.kb = reinterpret_cast<const uint16_t*>(a.k.data_ptr<at::BFloat16>());
    a.vb = reinterpret_cast<const uint16_t*>(a.v.data_ptr<at::BFloat16>());
  } else {
    a.kp = a.k.data_ptr<float>();
    a.vp = a.v.data_ptr<float>();
  }
  a.op = a.out.data_ptr<float>();
  a.ks1 = a.k.stride(1), a.ks2 = a.k.stride(2), a.vs1 = a.v.stride(1), a.vs2 = a.v.stride(2), a.group = H / Hkv;
  a.sc = static_cast<float>(scale);
#ifdef LEAPDECODE_X86
  if (!portable && has_avx2_fma()) {
    a.scores = scores_avx2;
    a.softmax = softmax_weights_avx2;
    a.mix = mix_avx2;
    if (has_avx512vl()) {
      a.scores_rows = scores_rows_avx512_any;
      a.mix_rows = mix_rows_avx512_any;
    }
  }
#else
  (void)portable;
#endif
  // Every query head of a kv head, and every row, reads the same keys and values: a task takes a
  // kv head and some of its query heads, and walks the cache in 32 KB chunks that stay in cache,
  // each (head, row) taking its visible keys of the chunk in cache order. Its arithmetic is the one
  // (head, row) alone would do, so the split changes no bit; it only reads the cache once per
  // task instead of once per (head, row) (at 1500 cached tokens a kv head's keys and values are
  // 1.5 MB, more than L2).
  // As few tasks as keep the threads evenly busy (a task's heads share its reads of the cache):
  // the fewest head tiles per kv head that make the task count a multiple of the threads.
  const int64_t threads = at::get_num_threads();
  int64_t tiles = 1;
  while (tiles < a.group && (Hkv * tiles) % threads != 0) ++tiles;
  a.per_tile = (a.group + tiles - 1) / tiles;  // heads per task
  a.tiles = (a.group + a.per_tile - 1) / a.per_tile;
  a.chunk = std::max<int64_t>(8, kChunkBytes / (4 * D));  // keys per chunk
  a.row_tile = std::max<int64_t>(kSharedRows, kTileWeightBytes / (4 * a.per_tile * T));  // rows a task scores at once
  return a;
}

// Tasks t0 .. t1 of `a` (each a kv head and some of its query heads), into its zeroed output.
// A task takes its rows a tile at a time (`a.row_tile` of them): its scores, its weights and its
// key lists are the tile's, a few hundred KB that stay in cache, where a whole long prompt's chunk
// (256 rows over 8,192 keys) would write and read back tens of MB; each (head, row) pair's
// arithmetic is the same in any tile, so the split changes no bit.
void attend_tasks(const Attention& a, int64_t t0, int64_t t1) {
  const int64_t H = a.H, Q = a.Q, D = a.D, T = a.T, group = a.group, tiles = a.tiles, per_tile = a.per_tile, chunk = a.chunk;
  const int64_t RT = std::min(a.row_tile, Q);
  const bool bf16 = a.bf16;
  const float *qp = a.qp, *kp = a.kp, *vp = a.vp;
  const uint16_t *kb = a.kb, *vb = a.vb;
  const bool* mp = a.mp;
  float* op = a.op;
  const int64_t ks1 = a.ks1, ks2 = a.ks2, vs1 = a.vs1, vs2 = a.vs2;
  const float sc = a.sc;
  const auto scores = a.scores;
  const auto softmax = a.softmax;
  const auto mix = a.mix;
  const auto scores_rows = a.scores_rows;
  const auto mix_rows = a.mix_rows;
  const std::unique_ptr<int64_t[]> keys(new int64_t[RT * T]);  // [tile row][n]; not zeroed: only the filled part is read
  const std::unique_ptr<float[]> weights(new float[per_tile * RT * T]);  // [head][tile row][n]
  std::vector<int64_t> counts(RT);
  std::vector<float> totals(per_tile * RT);
  std::vector<int64_t> at(RT), ends(RT);  // each tile row's position in its key list (all its heads')
  std::vector<char> dense(RT);  // whether a tile row's keys in the chunk are a range
  std::vector<float> kwide, vwide;  // bfloat16: the task's kv head's keys and values, widened
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t kvh = t / tiles, h0 = kvh * group + t % tiles * per_tile;
    const int64_t h1 = std::min(h0 + per_tile, (kvh + 1) * group);
    const float* kh = bf16 ? widen(kb + kvh * ks1, ks2, T, D, kwide) : kp + kvh * ks1;
    const float* vh = bf16 ? widen(vb + kvh * vs1, vs2, T, D, vwide) : vp + kvh * vs1;
    const int64_t kstep = bf16 ? D : ks2, vstep = bf16 ? D : vs2;  // floats from one key (value) to the next
    for (int64_t i0 = 0; i0 < Q; i0 += RT) {
      const int64_t i1 = std::min(Q, i0 + RT);
      for (int64_t i = i0; i < i1; ++i) {  // the rows' visible keys, shared by the heads
        int64_t* row = keys.get() + (i - i0) * T;
        int64_t n = 0;
        if (mp) {
          for (int64_t j = 0; j < T; ++j)
            if (mp[i * T + j]) row[n++] = j;
        } else {
          for (; n <= T - Q + i; ++n) row[n] = n;
        }
        counts[i - i0] = n;
      }
      // (head h, row i)'s index in the tile, its key list, its scores (then weights) from its list's position `start`
      auto pair = [&](int64_t h, int64_t i) { return (h - h0) * RT + (i - i0); };
      auto keys_of = [&](int64_t i) { return keys.get() + (i - i0) * T; };
      auto weights_at = [&](int64_t h, int64_t i, int64_t start) { return weights.get() + pair(h, i) * T + start; };
      // walks the cache chunk by chunk: visit(rows, hs, is, starts, count) for each run of (head,
      // row) pairs (hs[r], is[r]), r < rows, with the same visible keys of the chunk (a dense range:
      // a chain's rows see the same prefix, and every head of the task the same keys as its rows),
      // pair r's keys being keys_of(is[r]) + starts[r] .. (count of them, in order); a row with
      // other keys (a tree's) comes alone. A run spans heads: one row's heads share their loads of
      // the keys as a chain's rows do. Each pair still takes its keys in cache order, chunk after
      // chunk, so its arithmetic is unchanged.
      // `stream`: the keys (or values) the visits read, `step` floats apart: the next chunk's are
      // prefetched while this one's are used (a packed pass's sequences each read a cache of their
      // own, from memory, and the hardware prefetcher alone left a core waiting on them).
      auto by_chunk = [&](const float* stream, int64_t step, auto&& visit) {
        std::fill(at.begin(), at.end(), 0);
        for (int64_t j0 = 0; j0 < T; j0 += chunk) {
#ifdef LEAPDECODE_X86
          for (int64_t j = j0 + chunk; j < std::min(T, j0 + 2 * chunk); ++j)
            for (int64_t d = 0; d < D; d += 16) _mm_prefetch(reinterpret_cast<const char*>(stream + j * step + d), _MM_HINT_T0);
#else
          (void)stream, (void)step;
#endif
          // each row's keys in the chunk, the same for all its heads: [at[r], ends[r]) of its list
          for (int64_t r = 0; r < i1 - i0; ++r) {
            const int64_t* row = keys.get() + r * T;  // sorted: the chunk's keys end where j0 + chunk would go
            const int64_t start = at[r], limit = std::min(counts[r], start + chunk);  // at most `chunk` keys
            // a dense row takes the whole chunk (or its end) in one comparison; others search
            const int64_t end = limit > start && row[limit - 1] < j0 + chunk
                                    ? limit
                                    : std::lower_bound(row + start, row + limit, j0 + chunk) - row;
            ends[r] = end;
            dense[r] = end > start && row[end - 1] - row[start] == end - start - 1;
          }
          int64_t hs[kSharedRows], is[kSharedRows], starts[kSharedRows];
          int rows = 0;
          int64_t lo = -1, len = 0;  // the run's dense range [lo, lo + len), or lo = -1: none
          for (int64_t h = h0; h < h1; ++h)
            for (int64_t i = i0; i < i1; ++i) {
              const int64_t r = i - i0, start = at[r], end = ends[r];
              if (end == start) continue;
              const int64_t* row = keys.get() + r * T;
              if (rows > 0 && (!dense[r] || row[start] != lo || end - start != len || rows == kSharedRows)) {
                visit(rows, hs, is, starts, len);
                rows = 0;
              }
              if (!dense[r]) {
                const int64_t h1s[1] = {h}, i1s[1] = {i}, s1s[1] = {start};
                visit(1, h1s, i1s, s1s, end - start);
                continue;
              }
              lo = row[start], len = end - start;
              hs[rows] = h, is[rows] = i, starts[rows] = start;
              ++rows;
            }
          if (rows > 0) visit(rows, hs, is, starts, len);
          std::copy(ends.begin(), ends.begin() + (i1 - i0), at.begin());
        }
      };
      // 1. scores
      by_chunk(kh, kstep, [&](int rows, const int64_t* hs, const int64_t* is, const int64_t* starts, int64_t count) {
        const int64_t* first = keys_of(is[0]) + starts[0];
        if (scores_rows) {  // one pair too: its 512-bit path gives the same bits
          const float* qs[kSharedRows];
          float* outs[kSharedRows];
          for (int r = 0; r < rows; ++r) {
            qs[r] = qp + (hs[r] * Q + is[r]) * D;
            outs[r] = weights_at(hs[r], is[r], starts[r]);
          }
          return scores_rows(rows, qs, kh, kstep, first, count, D, sc, outs);
        }
        for (int r = 0; r < rows; ++r)
          scores(qp + (hs[r] * Q + is[r]) * D, kh, kstep, keys_of(is[r]) + starts[r], count, D, sc,
                 weights_at(hs[r], is[r], starts[r]));
      });
      // 2. each (head, row)'s softmax weights
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t n = counts[i - i0];
          float* w = weights_at(h, i, 0);
          totals[pair(h, i)] = n ? softmax(w, n, row_max(w, n)) : 0.f;
        }
      // 3. the weighted values, into the zeroed output
      by_chunk(vh, vstep, [&](int rows, const int64_t* hs, const int64_t* is, const int64_t* starts, int64_t count) {
        if (mix_rows) {
          float* outs[kSharedRows];
          const float* es[kSharedRows];
          for (int r = 0; r < rows; ++r) {
            outs[r] = op + (is[r] * H + hs[r]) * D;
            es[r] = weights_at(hs[r], is[r], starts[r]);
          }
          return mix_rows(rows, outs, es, vh, vstep, keys_of(is[0]) + starts[0], count, D);
        }
        for (int r = 0; r < rows; ++r)
          mix(op + (is[r] * H + hs[r]) * D, weights_at(hs[r], is[r], starts[r]), vh, vstep, keys_of(is[r]) + starts[r], count, D);
      });
      // 4. normalise (a row that sees nothing stays zero: never in a decode pass)
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t i = i0; i < i1; ++i) {
          if (!counts[i - i0]) continue;
          float* orow = op + (i * H + h) * D;
          const float inv = 1.f / totals[pair(h, i)];
          for (int64_t d = 0; d < D; ++d) orow[d] *= inv;
        }
    }
  }
}

}  // namespace

// query [1, H, Q, D]; key, value [1, Hkv, T, D] (any strides but the last, e.g. views of a longer
// cache); visible [Q, T] bool, or None: causal, the queries being the last Q positions. Returns
// [1, Q, H, D]: softmax(scale * q.k) over each row's visible keys, times their values.
torch::Tensor row_exact_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                  const std::optional<torch::Tensor>& visible, double scale, bool portable) {
  const Attention a = prepare(query, key, value, visible, scale, portable);
  at::parallel_for(0, a.tasks(), 1, [&](int64_t t0, int64_t t1) { attend_tasks(a, t0, t1); });
  return a.bf16 ? a.out.to(torch::kBFloat16) : a.out;
}

// `row_exact_attention` of several sequences' queries, each over its own keys and values, in one
// parallel region (a packed pass's attention in a layer: one fork of the threads, not one a
// sequence). Each output is the one its own call gives, bitwise: the same tasks, split otherwise.
std::vector<torch::Tensor> row_exact_attentions(const std::vector<torch::Tensor>& queries, const std::vector<torch::Tensor>& keys,
                                                const std::vector<torch::Tensor>& values,
                                                const std::vector<std::optional<torch::Tensor>>& visible, double scale, bool portable) {
  const size_t S = queries.size();
  TORCH_CHECK(keys.size() == S && values.size() == S && visible.size() == S,
              "row_exact_attentions: a key, a value and a mask (or None) per query expected");
  std::vector<Attention> calls;
  std::vector<int64_t> first{0};  // each call's first task
  calls.reserve(S);
  for (size_t s = 0; s < S; ++s) {
    calls.push_back(prepare(queries[s], keys[s], values[s], visible[s], scale, portable));
    first.push_back(first.back() + calls.back().tasks());
  }
  at::parallel_for(0, first.back(), 1, [&](int64_t t0, int64_t t1) {
    for (size_t s = 0; s < S; ++s) {
      const int64_t lo = std::max(t0, first[s]), hi = std::min(t1, first[s + 1]);
      if (lo < hi) attend_tasks(calls[s], lo - first[s], hi - first[s]);
    }
  });
  std::vector<torch::Tensor> outs;
  for (const Attention& a : calls) outs.push_back(a.bf16 ? a.out.to(torch::kBFloat16) : a.out);
  return outs;
}

namespace {

// ---- bfloat16 linear layers ----
// y[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]) for bfloat16 x, w and bias: each (row, output)
// pair has one accumulator of 16 float lanes fed by `vdpbf16ps` (two bf16 products a lane per
// instruction) over k in order, the tail through the same instruction on zero-padded lanes, one
// fixed horizontal sum, the bias, and one rounding to bfloat16. How many rows and outputs share a
// weight load only decides which accumulators sit side by side, never a pair's sequence: row i of
// an M-row call is bit-identical to a one-row call. The products are bf16 x bf16 (exact in float),
// the sums float, as in oneDNN's bf16 GEMM that `nn.Linear` uses; the difference is the cost: the
// weights stream once for all rows, so one row runs at memory speed (qwen2.5-coder-1.5b: a
// one-token pass 88 ms against oneDNN's 210) and more rows add only their products (measured in
// cache: ~19 bf16 multiply-adds a cycle a core, so 8 rows of the 1.5B are ~1.5-2x one).

// Portable path (no AVX512-BF16): the same structure in scalar code; row-exact, not the same bits
// as the vector path (its lane pairs are summed in another order).
void bf16_rows_portable(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N,
                        int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* xr = x + m * K;
      float part[16] = {0};
      for (int64_t k = 0; k < K; ++k) part[(k / 2) % 16] += bf16_value(xr[k]) * bf16_value(wr[k]);
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += part[j];
      if (bias) s += bf16_value(bias[n]);
      y[m * N + n] = c10::BFloat16(s).x;  // round to nearest even, as torch does
    }
  }
}

#ifdef LEAPDECODE_X86
#define LEAPDECODE_AVX512_BF16 "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma"
constexpr int kBf16RowBlock = 8;  // rows sharing one load of a weight chunk (up to 8 x 3 accumulators)

// MB rows against NB consecutive outputs n..n+NB-1: MB x NB accumulators in registers; PF: bytes
// ahead of each weight row to prefetch (0: leave it to the hardware prefetcher).
template <int MB, int NB, int PF>
__attribute__((target(LEAPDECODE_AVX512_BF16))) inline void bf16_block(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                                                                       uint16_t* y, int64_t N, int64_t K, int64_t n) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = w + (n + j) * K;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      if (PF) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + PF, _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_loadu_si512(wr[j] + k);
    }
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if (k < K) {  // the last K % 32 elements, the missing ones read as zeros
    const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr[j] + k);
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + i * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = _mm512_reduce_add_ps(acc[i][j]);
      if (bias) s += bf16_value(bias[n + j]);
      y[i * N + n + j] = c10::BFloat16(s).x;
    }
}

// Every row block against outputs n0..n1 in groups of NB (then one by one): a group's weights
// are read from memory once, from cache for the following row blocks.
template <int NB, int PF>
__attribute__((target(LEAPDECODE_AVX512_BF16))) void bf16_span(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                                                               int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  auto group = [&](auto nb, int64_t n) {
    constexpr int G = decltype(nb)::value;
    for (int64_t m0 = 0; m0 < M; m0 += kBf16RowBlock) {
      const uint16_t* xb = x + m0 * K;
      uint16_t* yb = y + m0 * N;
      switch (std::min<int64_t>(kBf16RowBlock, M - m0)) {
        case 1: bf16_block<1, G, PF>(xb, w, bias, yb, N, K, n); break;
        case 2: bf16_block<2, G, PF>(xb, w, bias, yb, N, K, n); break;
        case 3: bf16_block<3, G, PF>(xb, w, bias, yb, N, K, n); break;
        case 4: bf16_block<4, G, PF>(xb, w, bias, yb, N, K, n); break;
        case 5: bf16_block<5, G, PF>(xb, w, bias, yb, N, K, n); break;
        case 6: bf16_block<6, G, PF>(xb, w, bias, yb, N, K, n); break;
        case 7: bf16_block<7, G, PF>(xb, w, bias, yb, N, K, n); break;
        default: bf16_block<8, G, PF>(xb, w, bias, yb, N, K, n); break;
      }
    }
  };
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) group(std::integral_constant<int, NB>{}, n);
  for (; n < n1; ++n) group(std::integral_constant<int, 1>{}, n);
}

// Which weights share the rows' loads, by where the rows' activations live. While they fit in
// L1 beside the stream (M x K x 2 bytes up to 20 KB), one weight row at a time, one sequential
// stream per thread, is fastest (qwen2.5-coder-1.5b shapes, 2 cores: a one-row LM head ~30 GB/s;
// two or three weight rows in lockstep 13-15 GB/s). Past that (the 8960-wide down projection from
// 2 rows, any layer from ~7 rows) every weight row would pull the activations through L1 again:
// three outputs share each activation load and prefetching 4 KB ahead helps (down projection,
// 2 / 4 / 8 rows: 27 / 34 / 46 ms against 21 / 25 / 29 for a stack of 12).
constexpr int64_t kActivationBytesInL1 = 20 * 1024;

__attribute__((target(LEAPDECODE_AVX512_BF16))) void bf16_rows_avx512(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                                                                      uint16_t* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  if (M * K * 2 <= kActivationBytesInL1)
    bf16_span<1, 0>(x, w, bias, y, M, N, K, n0, n1);
  else
    bf16_span<3, 4096>(x, w, bias, y, M, N, K, n0, n1);
}
#endif

// Rows of a linear layer over outputs n0..n1 (y [M, N] from x [M, K], w [N, K], bias [N] or null).
template <typename T>
using LinearRows = void (*)(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t, int64_t);

template <typename T>
void linear_by_outputs(LinearRows<T> rows, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const T* xp = static_cast<const T*>(x.data_ptr());
  const T* wp = static_cast<const T*>(w.data_ptr());
  const T* bp = bias.numel() ? static_cast<const T*>(bias.data_ptr()) : nullptr;
  T* yp = static_cast<T*>(y.data_ptr());
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { rows(xp, wp, bp, yp, M, N, K, n0, n1); });  // threads split outputs, never sums
}

}  // namespace

// x [M, K], w [N, K], bias [N] or empty: all float32, or all bfloat16 (bfloat16 products, float
// sums, one rounding an output). `portable` forces the scalar path, which a CPU without AVX2/FMA
// (float32) or AVX512-BF16 (bfloat16) takes anyway.
torch::Tensor row_exact_linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias, bool portable) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "row_exact_linear: x [M, K] and w [N, K] expected");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) && w.scalar_type() == dtype &&
                  (bias.numel() == 0 || (bias.scalar_type() == dtype && bias.numel() == w.size(0))),
              "row_exact_linear: float32 or bfloat16 x, w and bias of one dtype expected");
  x = x.contiguous();
  w = w.contiguous();
  if (bias.numel()) bias = bias.contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  if (dtype == torch::kFloat) {
    LinearRows<float> rows = rows_portable;
#ifdef LEAPDECODE_X86
    if (!portable && has_avx2_fma()) rows = rows_avx2;
#endif
    linear_by_outputs(rows, x, w, bias, y);
  } else {
    LinearRows<uint16_t> rows = bf16_rows_portable;
#ifdef LEAPDECODE_X86
    if (!portable && has_avx512_bf16()) rows = bf16_rows_avx512;
#endif
    linear_by_outputs(rows, x, w, bias, y);
  }
  return y;
}

// RMS norm, y = w * (x * (1 / sqrt(mean(x^2) + eps))), each row on its own (8 lanes of squares,
// `lanes_sum`, then the tail; both paths the same sequence): x [..., D], w [D], float32.
torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& weight, double eps, bool portable) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat &&
                  weight.dim() == 1 && weight.size(0) == x_in.size(-1),
              "rms_norm: x [..., D] and weight [D] float32 expected");
  const torch::Tensor x = x_in.contiguous(), w = weight.contiguous();
  const int64_t D = x.size(-1), M = D ? x.numel() / D : 0;
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool fast = !portable && has_avx2_fma();
  const float e = static_cast<float>(eps);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * D;
    float* yr = yp + m * D;
    float squares;
#ifdef LEAPDECODE_X86
    if (fast)
      squares = sum_squares_avx2(xr, D);
    else
#endif
      squares = dot_portable(xr, xr, D);
    const float r = 1.f / std::sqrt(squares / static_cast<float>(D) + e);
    for (int64_t d = 0; d < D; ++d) yr[d] = wp[d] * (xr[d] * r);
  }
  return y;
}

static bool fast_path_available() { return has_avx2_fma(); }

// Built into another extension (`lean.cpp`), this file gives its functions and no module of its own.
#ifndef LEAPDECODE_NO_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_exact_linear", &row_exact_linear, py::call_guard<py::gil_scoped_release>(), "row-exact linear (float32, or bfloat16 through AVX512-BF16)");
  m.def("row_exact_attention", &row_exact_attention, py::call_guard<py::gil_scoped_release>(), "attention, each query row over its visible keys, rows bit-exact");
  m.def("row_exact_attentions", &row_exact_attentions, py::call_guard<py::gil_scoped_release>(), "row_exact_attention of several sequences in one parallel region");
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), "RMS norm, rows independent");
  m.def("bf16_path_available", &has_avx512_bf16, "whether the AVX512-BF16 path of the bfloat16 linear runs on this CPU");
  m.def("fast_path_available", &fast_path_available, "whether the AVX2/FMA path runs on this CPU");
}
#endif
