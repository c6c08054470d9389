// Group-quantized linear layers: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// Weights come in groups of 32 along k (GGUF's block size): int8 with a scale per group
// (w = d * q, GGUF's Q8_0), 4-bit with a scale and a minimum per group (w = d * q + min, q in
// 0..15; Q4_0, Q4_1 and Q4_K all fit), or 6-bit with a scale per 16 weights
// (w = d * sc * (q - 32), q in 0..63, sc int8: GGUF's Q6_K exactly). Activations are quantized at run time, per row and group, to
// int8 with their own scale (as llama.cpp does), so each group's dot product is an exact integer.
//
// Packed layout (built once at load, `packing.pack`): outputs in blocks of 8, and for each block
// and group one contiguous record, so a block streams from memory in one sequential read. A
// record's weights (its body):
//   int4 (128 bytes): 4 x 32 bytes of nibbles. In the k-th 32 bytes, byte 4j+e holds q[j][4k+e]
//        (low nibble) and q[j][16+4k+e] (high).
//   int8 (256 bytes): 8 x 32 bytes, the c-th holding q[j][4c+e] + 128 at byte 4j+e (offset binary:
//        `vpdpbusd` multiplies unsigned by signed bytes, and the 128 x sum(x) it adds comes off as
//        one integer per row and group; the AVX2 path flips the top bit back).
//   6-bit (192 bytes): the low 4 bits as int4's 128 bytes, then 2 x 32 bytes of high bit pairs:
//        in the h-th, bits 2k..2k+1 of byte 4j+e are the top two bits of q[j][16h+4k+e].
// The scales come in one of two forms:
//   per group: the body is followed by the 8 scales (and for int4 the 8 minimums) as float32
//        (192 / 288 bytes a record); any scales fit (GGUF's Q4_0, Q4_1, Q8_0 take this form);
//   super-blocks: each run of 8 groups (the last may be shorter) starts with a header of 8 float32
//        factors d (int4: then 8 factors dmin), and each record holds its 8 scales as uint8 sc
//        (int4: then its 8 minimums as int8 m): scale = d * sc, minimum = dmin * m, one float32
//        product each (GGUF's Q4_K is this form exactly; 144 / 264 bytes a record plus the header,
//        a quarter fewer bytes to read per int4 weight than per group). 6-bit records hold the 8
//        outputs' int8 sc of the group's first 16 weights, then of its last 16 (208 bytes): those
//        multiply the two halves' integer sums, and d the group's (the only form for 6 bits).
// Lane j of a vector is output j of the block: one `maddubs` multiplies four weights of each of
// the eight outputs by the same four activations (broadcast), so a group costs a few vector
// instructions for eight outputs, the group's scales multiply as one vector, and no horizontal
// sum is needed.
//
// Three paths, chosen at run time (`isa`): portable scalar code, AVX2 (`maddubs`), and
// AVX512-VNNI (`vpdpbusd` on the same 256-bit layout: one instruction where AVX2 needs two or three,
// and twice the registers; past 2 rows, two output blocks side by side in 512-bit vectors). The
// integer dot products are exact on every path, so all three give the same integers and, with the
// float sequence below, the same bits.
//
// Row-exact by construction: every (output, row) value is the same sequence of float operations
// whatever the number of rows M (per group, in order: acc = fma(float(dot), d_w * d_x, acc), then
// for int4 acc = fma(min, d_x * sum(q_x), acc), with d_w and min the stored floats or the
// super-block products, for 6 bits d_w = d and dot = sc_a * dot_a + sc_b * dot_b over the halves,
// exact integers); the unpacked weights are only shared between
// rows. So row i of an M-row call is bit-identical to a 1-row call on that row, and the portable
// path, which computes the same sequence in scalar code, gives the same bits. Threads split the
// output blocks, never the reduction.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "simd.h"

// GCC otherwise regroups the integer sums of the row blocks into wide trees and spills them to the
// stack; with these and `pin` the inner loops keep every partial sum in a register (measured ~20%
// faster for 4-16 rows, no change for one row). Integer sums are exact, so the order is free.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-tree-reassoc", "schedule-insns", "sched-pressure")
#endif

namespace {

using leapdecode::has_avx2_fma;
using leapdecode::has_avx512_vnni;

// The instruction-set paths (`isa` argument; kBest: the fastest this CPU runs).
constexpr int64_t kBest = -1, kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2;

int64_t best_isa() { return has_avx512_vnni() ? kAvx512Vnni : has_avx2_fma() ? kAvx2 : kPortable; }

constexpr int64_t kGroup = 32;  // weights (and activations) per group along k
constexpr int64_t kBlock = 8;   // outputs per packed block (one float per lane of an AVX2 vector)
constexpr int kRowBlock = 4;    // rows sharing one unpacking of a block's group
constexpr int kRowBlockVnni = 8;  // the same with AVX512's 32 registers
constexpr int64_t kPrefetch = 4096;  // how far ahead of the record in use a one-block stream prefetches (1024: 2-7% slower at 1-8 rows, measured)

constexpr int64_t kSuper = 8;   // groups per super-block (one header of factors)

// Bytes of the packed layout: a record's weights, a record, a super-block's header, an output block.
constexpr int64_t body_bytes(int bits) { return bits == 4 ? 128 : bits == 6 ? 192 : 256; }
constexpr int64_t record_bytes(int bits, bool super) {
  return body_bytes(bits) + (bits == 6 ? 16 : (super ? 8 : 32) * (bits == 4 ? 2 : 1));
}
constexpr int64_t header_bytes(int bits, bool super) { return super ? 32 * (bits == 4 ? 2 : 1) : 0; }
constexpr int64_t block_bytes(int bits, bool super, int64_t G) {
  return G * record_bytes(bits, super) + (G + kSuper - 1) / kSuper * header_bytes(bits, super);
}

// Walks one output block's records in order; `head` is the current super-block's header.
template <int BITS, bool SUPER>
struct Records {
  const uint8_t* rec;
  const uint8_t* head = nullptr;
  // moves to group g (called for g = 0, 1, 2... in order) and returns its record
  inline const uint8_t* at(int64_t g) {
    if (g > 0) rec += record_bytes(BITS, SUPER);
    if (SUPER && g % kSuper == 0) {
      head = rec;
      rec += header_bytes(BITS, SUPER);
    }
    return rec;
  }
};

// Where a product's outputs go: row m's N outputs (+ bias) at y + m * stride, so that several
// products of one input can fill one tensor side by side (stride: all their outputs).
struct Out {
  float* y;
  int64_t stride;
  int64_t N;
  const float* bias;  // [N] or null
};

// M rows of activations quantized per group: q = round(x / d), d = max|x| / 127.
struct Rows {
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d;   // [M, G]
  std::vector<float> s;   // [M, G] d * sum(q): the group's sum as the products see it
  std::vector<int32_t> n;  // [M, G] sum(q)
  std::vector<int32_t> off;  // [M, G, 2] 32 sum(q) over the group's first 16, over its last 16 (6-bit layers)
};

// One group of 32 activations: q = round-half-even(x * (1 / d)), d = max|x| / 127; returns d and
// writes q. The AVX2 version below computes the same float operations (max is exact, the products
// are the same single roundings, cvtps rounds half to even as nearbyint does), so it gives the same
// bits; only the integer sum's order differs, which is exact.
float quantize_group_portable(const float* xs, int8_t* q, int32_t& sum) {
  float amax = 0.f;
  for (int j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(xs[j]));
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  sum = 0;
  for (int j = 0; j < kGroup; ++j) {
    const int32_t v = std::clamp(static_cast<int32_t>(std::nearbyint(xs[j] * inv)), -127, 127);
    q[j] = static_cast<int8_t>(v);
    sum += v;
  }
  return d;
}

#ifdef LEAPDECODE_X86
__attribute__((target("avx2,fma"))) float quantize_group_avx2(const float* xs, int8_t* q, int32_t& sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xs + 8 * i);
  const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.f;
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) n[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), lo), hi);
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  sum = _mm_cvtsi128_si32(t);
  // the packs work within 128-bit lanes: put the 4-byte chunks back in order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return d;
}
#endif

// `halves`: also each group's two halves' offsets, `off` (what 6-bit layers need, and only they).
Rows quantize_rows(const float* x, int64_t M, int64_t K, bool fast, bool halves = false) {
  const int64_t G = K / kGroup;
  Rows r{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G), std::vector<int32_t>(M * G),
         std::vector<int32_t>(halves ? 2 * M * G : 0)};
  // groups are independent: split them between threads (a 16-row pass has ~4500 of them)
  at::parallel_for(0, M * G, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int32_t sum = 0;
      float d;
#ifdef LEAPDECODE_X86
      if (fast)
        d = quantize_group_avx2(x + i * kGroup, r.q.data() + i * kGroup, sum);
      else
#endif
        d = quantize_group_portable(x + i * kGroup, r.q.data() + i * kGroup, sum);
      r.d[i] = d;
      r.s[i] = d * static_cast<float>(sum);
      r.n[i] = sum;
      if (halves) {
        const int8_t* q = r.q.data() + i * kGroup;
        const int32_t first = std::accumulate(q, q + kGroup / 2, 0);
        r.off[2 * i] = 32 * first;
        r.off[2 * i + 1] = 32 * (sum - first);
      }
    }
  });
  return r;
}

// Weight e (0..31) of output j (0..7) in a packed record (6 bits: q - 32).
inline int32_t packed_weight(const uint8_t* rec, int bits, int j, int e) {
  if (bits == 8) return static_cast<int32_t>(rec[32 * (e / 4) + 4 * j + e % 4]) - 128;
  const int c = e % 16;
  const uint8_t b = rec[32 * (c / 4) + 4 * j + c % 4];
  const int32_t low = e < 16 ? (b & 0x0F) : (b >> 4);
  if (bits == 4) return low;
  const uint8_t pairs = rec[128 + 32 * (e / 16) + 4 * j + c % 4];
  return (low | ((pairs >> (2 * (c / 4))) & 3) << 4) - 32;
}

// A 6-bit record's integer dot for output j: each half's sum times its int8 scale.
inline int32_t six_bit_dot(const uint8_t* rec, int j, const int8_t* xq) {
  int32_t half[2] = {0, 0};
  for (int e = 0; e < kGroup; ++e) half[e / 16] += packed_weight(rec, 6, j, e) * xq[e];
  const int8_t* sc = reinterpret_cast<const int8_t*>(rec + body_bytes(6));
  return half[0] * sc[j] + half[1] * sc[8 + j];
}

inline const float* floats_at(const uint8_t* p) { return reinterpret_cast<const float*>(p); }

// Output j's scale (which 0) or minimum (which 1) for the record `rec` of super-block header `head`.
inline float weight_factor(const uint8_t* head, const uint8_t* rec, int bits, bool super, int which, int j) {
  const uint8_t* tail = rec + body_bytes(bits);
  if (bits == 6) return floats_at(head)[j];  // the sub-scales went into the integer dot
  if (!super) return floats_at(tail + 32 * which)[j];
  const float d = floats_at(head + 32 * which)[j];
  return which == 0 ? d * static_cast<float>(tail[j]) : d * static_cast<float>(static_cast<int8_t>(tail[8 + j]));
}

// Portable path: the fast path's float sequence, one (output, row) at a time.
void blocks_portable(const Rows& r, const uint8_t* packed, int bits, bool super, const Out& out, int64_t M, int64_t K,
                     int64_t b0, int64_t b1) {
  const int64_t G = K / kGroup, rb = record_bytes(bits, super), hb = header_bytes(bits, super);
  for (int64_t b = b0; b < b1; ++b)
    for (int j = 0; j < kBlock && b * kBlock + j < out.N; ++j)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* head = packed + b * block_bytes(bits, super, G) + g / kSuper * (hb + kSuper * rb);
          const uint8_t* rec = head + hb + g % kSuper * rb;
          const int8_t* xq = r.q.data() + m * K + g * kGroup;
          int32_t dot = 0;
          if (bits == 6)
            dot = six_bit_dot(rec, j, xq);
          else
            for (int e = 0; e < kGroup; ++e) dot += packed_weight(rec, bits, j, e) * xq[e];
          const float scale = weight_factor(head, rec, bits, super, 0, j) * r.d[m * G + g];
          acc = std::fma(static_cast<float>(dot), scale, acc);
          if (bits == 4) acc = std::fma(weight_factor(head, rec, bits, super, 1, j), r.s[m * G + g], acc);
        }
        const int64_t n = b * kBlock + j;
        out.y[m * out.stride + n] = out.bias ? acc + out.bias[n] : acc;
      }
}

#ifdef LEAPDECODE_X86
// Keeps `v` in its register at this point of the sequence (stops the compiler reordering sums).
inline __attribute__((target("avx2,fma"))) void pin(__m256i& v) { asm("" : "+x"(v)); }

// Four activation bytes as one int32 (what a `vpdpbusd` lane multiplies by).
inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline __attribute__((target("avx2,fma"))) __m256i broadcast4(const int8_t* p) { return _mm256_set1_epi32(four_bytes(p)); }

// Calls block(rows, m0) on runs of up to ROWS rows, `rows` a compile-time constant (the kernels
// keep one accumulator per row in registers, so the row count is a template argument).
template <int ROWS, typename Block>
inline void with_rows(int64_t n, int64_t m0, Block& block) {
  if constexpr (ROWS > 1) {
    if (n < ROWS) return with_rows<ROWS - 1>(n, m0, block);
  }
  block(std::integral_constant<int, ROWS>{}, m0);
}

template <int ROWS, typename Block>
inline void row_blocks(int64_t M, Block&& block) {
  for (int64_t m0 = 0; m0 < M; m0 += ROWS) with_rows<ROWS>(std::min<int64_t>(ROWS, M - m0), m0, block);
}

// One group's float step for MB rows, the same on every vector path (the row-exact sequence at the
// top of this file): acc = fma(float(dot), d_w * d_x, acc), then for int4 acc = fma(min, d_x * sum(q_x), acc).
// 6 bits: chunk k's weights (k = 0..3 of a record's first half, or with the second half's high
// pairs and the high nibbles, of its second) as unsigned bytes, q = low | pair << 4.
inline __attribute__((target("avx2,fma"))) __m256i six_bit_chunk(__m256i low, __m256i pairs, int k) {
  const __m256i top = _mm256_set1_epi8(0x30);
  // 16-bit shifts move bits across bytes, but the mask keeps only each byte's own pair
  const __m256i high = k == 0 ? _mm256_slli_epi16(pairs, 4) : k == 1 ? _mm256_slli_epi16(pairs, 2) : k == 2 ? pairs : _mm256_srli_epi16(pairs, 2);
  return _mm256_or_si256(low, _mm256_and_si256(high, top));
}

// 6 bits: the halves' sums of unsigned q times x (`first`, `second`, per output) → the record's
// exact dot: sc_a * (first - 32 sum(x_a)) + sc_b * (second - 32 sum(x_b)).
template <int MB>
inline __attribute__((target("avx2,fma"))) void six_bit_dots(const Rows& r, int64_t m0, int64_t g, int64_t G, const uint8_t* rec,
                                                             const __m256i* first, const __m256i* second, __m256i* dot) {
  const __m256i sa = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + body_bytes(6))));
  const __m256i sb = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + body_bytes(6) + 8)));
  for (int i = 0; i < MB; ++i) {
    const int64_t at = (m0 + i) * G + g;
    const __m256i a = _mm256_sub_epi32(first[i], _mm256_set1_epi32(r.off[2 * at]));  // from memory: no scalar work
    const __m256i b = _mm256_sub_epi32(second[i], _mm256_set1_epi32(r.off[2 * at + 1]));
    dot[i] = _mm256_add_epi32(_mm256_mullo_epi32(a, sa), _mm256_mullo_epi32(b, sb));
  }
}

// The 8 outputs' scales (which 0) or minimums (which 1) of a record, as weight_factor computes them.
template <int BITS, bool SUPER>
inline __attribute__((target("avx2,fma"))) __m256 weight_factors(const uint8_t* head, const uint8_t* rec, int which) {
  const uint8_t* tail = rec + body_bytes(BITS);
  if constexpr (BITS == 6) return _mm256_loadu_ps(floats_at(head));
  if constexpr (!SUPER) return _mm256_loadu_ps(floats_at(tail + 32 * which));
  const __m128i subs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tail + 8 * which));  // 8 bytes
  const __m256i ints = which == 0 ? _mm256_cvtepu8_epi32(subs) : _mm256_cvtepi8_epi32(subs);
  return _mm256_mul_ps(_mm256_loadu_ps(floats_at(head + 32 * which)), _mm256_cvtepi32_ps(ints));
}

template <int MB, int BITS, bool SUPER>
inline __attribute__((target("avx2,fma"))) void scale_group(const Rows& r, int64_t m0, int64_t g, int64_t G, const Records<BITS, SUPER>& at,
                                                            const __m256i* dot, __m256* acc) {
  const __m256 dw = weight_factors<BITS, SUPER>(at.head, at.rec, 0);
  for (int i = 0; i < MB; ++i) {
    const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(r.d[(m0 + i) * G + g]));
    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), scale, acc[i]);
  }
  if constexpr (BITS == 4) {
    const __m256 mins = weight_factors<BITS, SUPER>(at.head, at.rec, 1);
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_fmadd_ps(mins, _mm256_set1_ps(r.s[(m0 + i) * G + g]), acc[i]);
  }
}

// The MB rows' sums of one output block into y (+ bias), the last block cut at N.
template <int MB>
inline __attribute__((target("avx2,fma"))) void store_rows(const __m256* acc, const Out& out, int64_t m0, int64_t b) {
  const int64_t n0 = b * kBlock, valid = std::min<int64_t>(kBlock, out.N - n0);
  for (int i = 0; i < MB; ++i) {
    alignas(32) float lanes[kBlock];
    _mm256_store_ps(lanes, acc[i]);
    float* dst = out.y + (m0 + i) * out.stride + n0;
    for (int j = 0; j < valid; ++j) dst[j] = out.bias ? lanes[j] + out.bias[n0 + j] : lanes[j];
  }
}

// One output block against MB rows starting at m0, all groups; the MB accumulators stay in
// registers. int4: per group, the 8 int16 partial sums of a row fit (8 x 2 x 15 x 127 < 2^15).
template <int MB, int BITS, bool SUPER>
__attribute__((target("avx2,fma"))) void block_avx2(const Rows& r, int64_t m0, const uint8_t* records, const Out& out, int64_t K,
                                                    int64_t b) {
  const int64_t G = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  Records<BITS, SUPER> at{records};
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = at.at(g);
    // the hardware prefetcher alone leaves half the bandwidth unused here: ask for records ahead
    for (int64_t line = 0; line < record_bytes(BITS, SUPER); line += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch + line), _MM_HINT_T0);
    __m256i dot[MB];
    if constexpr (BITS == 4) {
      __m256i s16[MB];
      for (int i = 0; i < MB; ++i) s16[i] = _mm256_setzero_si256();
      for (int k = 0; k < 4; ++k) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * k));
        const __m256i lo = _mm256_and_si256(raw, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        for (int i = 0; i < MB; ++i) {
          const int8_t* xq = r.q.data() + (m0 + i) * K + g * kGroup;
          s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(lo, broadcast4(xq + 4 * k)));
          s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(hi, broadcast4(xq + 16 + 4 * k)));
          pin(s16[i]);
        }
      }
      for (int i = 0; i < MB; ++i) dot[i] = _mm256_madd_epi16(s16[i], ones);
    } else if constexpr (BITS == 6) {
      // the group's weights as unsigned bytes (q, 0..63), unpacked once for all rows: w[k] chunk k
      // of its first 16 (k < 4), w[4 + k] of its last 16
      __m256i w[8];
      const __m256i pairs_a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 128));
      const __m256i pairs_b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 160));
      for (int k = 0; k < 4; ++k) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * k));
        w[k] = six_bit_chunk(_mm256_and_si256(raw, nibble), pairs_a, k);
        w[4 + k] = six_bit_chunk(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble), pairs_b, k);
      }
      // per row, two chunks' products summed as int16 before widening (2 x 2 x 63 x 127 < 2^15)
      __m256i first[MB], second[MB];
      for (int i = 0; i < MB; ++i) {
        const int8_t* xq = r.q.data() + (m0 + i) * K + g * kGroup;
        for (int h = 0; h < 2; ++h) {
          const __m256i* c = w + 4 * h;
          const int8_t* xh = xq + 16 * h;
          const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(c[0], broadcast4(xh)), _mm256_maddubs_epi16(c[1], broadcast4(xh + 4)));
          const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(c[2], broadcast4(xh + 8)), _mm256_maddubs_epi16(c[3], broadcast4(xh + 12)));
          (h == 0 ? first : second)[i] = _mm256_add_epi32(_mm256_madd_epi16(p01, ones), _mm256_madd_epi16(p23, ones));
        }
      }
      six_bit_dots<MB>(r, m0, g, G, rec, first, second, dot);
    } else {
      const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int i = 0; i < MB; ++i) dot[i] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * c)), offset);  // q
        const __m256i magnitude = _mm256_sign_epi8(w, w);  // |q| as unsigned (q = -128 gives 128)
        for (int i = 0; i < MB; ++i) {
          const int8_t* xq = r.q.data() + (m0 + i) * K + g * kGroup;
          const __m256i xs = _mm256_sign_epi8(broadcast4(xq + 4 * c), w);  // x with q's sign
          dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xs), ones));
        }
      }
    }
    scale_group<MB, BITS, SUPER>(r, m0, g, G, at, dot, acc);
  }
  store_rows<MB>(acc, out, m0, b);
}

template <int BITS, bool SUPER>
__attribute__((target("avx2,fma"))) void blocks_avx2(const Rows& r, const uint8_t* packed, const Out& out, int64_t M, int64_t K,
                                                     int64_t b0, int64_t b1) {
  const int64_t G = K / kGroup;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* rec = packed + b * block_bytes(BITS, SUPER, G);
    // the block's records stay in cache for the next rows
    row_blocks<kRowBlock>(M, [&](auto rows, int64_t m0) { block_avx2<decltype(rows)::value, BITS, SUPER>(r, m0, rec, out, K, b); });
  }
}

#define LEAPDECODE_VNNI "avx512f,avx512vl,avx512bw,avx512vnni,avx2,fma"

// The VNNI kernel's vectors: one output block in 256-bit vectors (`Ymm`), or two blocks side by
// side in 512-bit ones (`Zmm`: lanes 0-7 the first block, 8-15 the second). Each lane sees the same
// integers and the same float operations either way, so the two widths give the same bits; the
// wide one does twice the work per instruction (from 3 rows, `kWideRows`: at one or two a pass
// waits on memory, and one record stream per thread reads at least as fast).
struct Ymm {
  static constexpr int kBlocks = 1;
  using I = __m256i;
  using F = __m256;
  static inline __attribute__((target(LEAPDECODE_VNNI))) I load(const uint8_t* const* recs, int64_t at) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(recs[0] + at));
  }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I widen(const uint8_t* const* recs, int64_t at, bool sign) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(recs[0] + at));  // 8 bytes
    return sign ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  }
  static inline __attribute__((target(LEAPDECODE_VNNI))) F join(const __m256* halves) { return halves[0]; }
  static inline __attribute__((target(LEAPDECODE_VNNI))) void split(F v, __m256* halves) { halves[0] = v; }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I zero() { return _mm256_setzero_si256(); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) F zero_f() { return _mm256_setzero_ps(); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I bytes(char v) { return _mm256_set1_epi8(v); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I ints(int32_t v) { return _mm256_set1_epi32(v); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) F floats(float v) { return _mm256_set1_ps(v); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I left16(I a, int s) { return _mm256_slli_epi16(a, s); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I right16(I a, int s) { return _mm256_srli_epi16(a, s); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I dpbusd(I acc, I w, int32_t x4) { return _mm256_dpbusd_epi32(acc, w, _mm256_set1_epi32(x4)); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
};

struct Zmm {
  static constexpr int kBlocks = 2;
  using I = __m512i;
  using F = __m512;
  static inline __attribute__((target(LEAPDECODE_VNNI))) I load(const uint8_t* const* recs, int64_t at) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(recs[0] + at));
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(recs[1] + at)), 1);
  }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I widen(const uint8_t* const* recs, int64_t at, bool sign) {
    const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(recs[0] + at));
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(recs[1] + at));
    const __m256i lo = sign ? _mm256_cvtepi8_epi32(a) : _mm256_cvtepu8_epi32(a);
    const __m256i hi = sign ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  static inline __attribute__((target(LEAPDECODE_VNNI))) F join(const __m256* halves) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(halves[0])), _mm256_castps_pd(halves[1]), 1));
  }
  static inline __attribute__((target(LEAPDECODE_VNNI))) void split(F v, __m256* halves) {
    halves[0] = _mm512_castps512_ps256(v);
    halves[1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I zero() { return _mm512_setzero_si512(); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) F zero_f() { return _mm512_setzero_ps(); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I bytes(char v) { return _mm512_set1_epi8(v); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I ints(int32_t v) { return _mm512_set1_epi32(v); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) F floats(float v) { return _mm512_set1_ps(v); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I left16(I a, int s) { return _mm512_slli_epi16(a, s); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I right16(I a, int s) { return _mm512_srli_epi16(a, s); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) I dpbusd(I acc, I w, int32_t x4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4)); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) F to_float(I a) { return _mm512_cvtepi32_ps(a); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static inline __attribute__((target(LEAPDECODE_VNNI))) F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};

template <typename V>
inline __attribute__((target(LEAPDECODE_VNNI))) void pin_v(typename V::I& v) { asm("" : "+v"(v)); }

// six_bit_chunk on V's vectors.
template <typename V>
inline __attribute__((target(LEAPDECODE_VNNI))) typename V::I six_bit_chunk_v(typename V::I low, typename V::I pairs, int k) {
  const typename V::I high = k == 0 ? V::left16(pairs, 4) : k == 1 ? V::left16(pairs, 2) : k == 2 ? pairs : V::right16(pairs, 2);
  return V::or_(low, V::and_(high, V::bytes(0x30)));
}

// block_avx2 with `vpdpbusd` for V::kBlocks output blocks (`records[i]`, the i-th from block b):
// the same integers (each lane's four products summed exactly, no saturation: they fit int32), the
// same float sequence. Two integer chains per row (low and high nibbles, or even and odd weight
// chunks) so that the instruction's latency overlaps.
template <typename V, int MB, int BITS, bool SUPER>
__attribute__((target(LEAPDECODE_VNNI))) void block_vnni(const Rows& r, int64_t m0, const uint8_t* const* records, const Out& out,
                                                         int64_t K, int64_t b) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int B = V::kBlocks;
  const int64_t G = K / kGroup;
  const I nibble = V::bytes(0x0F);
  F acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = V::zero_f();
  Records<BITS, SUPER> at[B];
  for (int j = 0; j < B; ++j) at[j].rec = records[j];
  // B blocks side by side are B streams a block apart; prefetched a stream each they read slower
  // from a loaded memory (measured), and past a block's end a stream's prefetch ran into the block
  // beside it. So the next B blocks (contiguous) are prefetched as one stream instead, as far as B
  // times the records read so far: each of their lines once, all of them by the end of these. Only
  // by the first row block: the others read these blocks again from cache.
  const uint8_t* next = records[0] + B * block_bytes(BITS, SUPER, G);
  int64_t line = -static_cast<int64_t>(reinterpret_cast<uintptr_t>(next) & 63);  // next's first line
  const bool ahead = B > 1 && m0 == 0;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec[B];
    for (int j = 0; j < B; ++j) rec[j] = at[j].at(g);
    if constexpr (B == 1) {  // one stream: kPrefetch ahead of it
      for (int64_t l = 0; l < record_bytes(BITS, SUPER); l += 64) _mm_prefetch(reinterpret_cast<const char*>(rec[0] + kPrefetch + l), _MM_HINT_T0);
    } else if (ahead) {
      for (const int64_t upto = B * (rec[0] + record_bytes(BITS, SUPER) - records[0]); line < upto; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T0);
    }
    I even[MB], odd[MB];
    for (int i = 0; i < MB; ++i) even[i] = odd[i] = V::zero();
    if constexpr (BITS == 4 || BITS == 6) {  // even: the group's first 16 weights, odd: its last 16
      I pairs_a = V::zero(), pairs_b = V::zero();
      if constexpr (BITS == 6) {
        pairs_a = V::load(rec, 128);
        pairs_b = V::load(rec, 160);
      }
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const I raw = V::load(rec, 32 * k);
        I lo = V::and_(raw, nibble);
        I hi = V::and_(V::right16(raw, 4), nibble);
        if constexpr (BITS == 6) {
          lo = six_bit_chunk_v<V>(lo, pairs_a, k);
          hi = six_bit_chunk_v<V>(hi, pairs_b, k);
        }
        for (int i = 0; i < MB; ++i) {
          const int8_t* xq = r.q.data() + (m0 + i) * K + g * kGroup;
          even[i] = V::dpbusd(even[i], lo, four_bytes(xq + 4 * k));
          odd[i] = V::dpbusd(odd[i], hi, four_bytes(xq + 16 + 4 * k));
          pin_v<V>(even[i]);
          pin_v<V>(odd[i]);
        }
      }
    } else {
#pragma GCC unroll 4
      for (int c = 0; c < 8; c += 2) {  // chunks c and c + 1 on the two chains
        const I w0 = V::load(rec, 32 * c);  // q + 128
        const I w1 = V::load(rec, 32 * c + 32);
        for (int i = 0; i < MB; ++i) {
          const int8_t* xq = r.q.data() + (m0 + i) * K + g * kGroup;
          even[i] = V::dpbusd(even[i], w0, four_bytes(xq + 4 * c));
          odd[i] = V::dpbusd(odd[i], w1, four_bytes(xq + 4 * c + 4));
          pin_v<V>(even[i]);
          pin_v<V>(odd[i]);
        }
      }
    }
    I dot[MB];
    if constexpr (BITS == 6) {  // the halves' exact dot: sc_a * (even - 32 sum(x_a)) + sc_b * (odd - 32 sum(x_b))
      const I sa = V::widen(rec, body_bytes(6), true), sb = V::widen(rec, body_bytes(6) + 8, true);
      for (int i = 0; i < MB; ++i) {
        const int32_t* off = r.off.data() + 2 * ((m0 + i) * G + g);
        dot[i] = V::add(V::mullo(V::sub(even[i], V::ints(off[0])), sa), V::mullo(V::sub(odd[i], V::ints(off[1])), sb));
      }
    } else {
      for (int i = 0; i < MB; ++i) dot[i] = V::add(even[i], odd[i]);
      if constexpr (BITS == 8)
        for (int i = 0; i < MB; ++i) dot[i] = V::sub(dot[i], V::ints(128 * r.n[(m0 + i) * G + g]));
    }
    // the float step (scale_group's, on V's lanes)
    __m256 parts[B];
    for (int j = 0; j < B; ++j) parts[j] = weight_factors<BITS, SUPER>(at[j].head, rec[j], 0);
    const F dw = V::join(parts);
    for (int i = 0; i < MB; ++i) acc[i] = V::fmadd(V::to_float(dot[i]), V::mul(dw, V::floats(r.d[(m0 + i) * G + g])), acc[i]);
    if constexpr (BITS == 4) {
      for (int j = 0; j < B; ++j) parts[j] = weight_factors<BITS, SUPER>(at[j].head, rec[j], 1);
      const F mins = V::join(parts);
      for (int i = 0; i < MB; ++i) acc[i] = V::fmadd(mins, V::floats(r.s[(m0 + i) * G + g]), acc[i]);
    }
  }
  __m256 sums[B][MB];
  for (int i = 0; i < MB; ++i) {
    __m256 halves[B];
    V::split(acc[i], halves);
    for (int j = 0; j < B; ++j) sums[j][i] = halves[j];
  }
  for (int j = 0; j < B; ++j) store_rows<MB>(sums[j], out, m0, b + j);
}

// Rows past which the two-block (512-bit) kernel takes over (measured on the 1.5B's layers, Zen 5:
// at 1-2 rows a pass waits on memory and one record stream per thread is as fast or faster; from
// 3 rows the 256-bit kernel is bound by its `vpdpbusd` rate: the wide one's products take 0.86x
// the time at 3 rows and 0.73-0.81x at 4 with memory to spare, 1.03-1.06x and 0.93-0.97x with
// memory loaded, ~0.8x from 6 rows either way).
constexpr int64_t kWideRows = 2;

template <int BITS, bool SUPER>
__attribute__((target(LEAPDECODE_VNNI))) void blocks_vnni(const Rows& r, const uint8_t* packed, const Out& out, int64_t M, int64_t K,
                                                          int64_t b0, int64_t b1) {
  const int64_t G = K / kGroup, bytes = block_bytes(BITS, SUPER, G);
  int64_t b = b0;
  if (M > kWideRows)
    for (; b + 1 < b1; b += 2) {
      const uint8_t* recs[2] = {packed + b * bytes, packed + (b + 1) * bytes};
      row_blocks<kRowBlockVnni>(M, [&](auto rows, int64_t m0) { block_vnni<Zmm, decltype(rows)::value, BITS, SUPER>(r, m0, recs, out, K, b); });
    }
  for (; b < b1; ++b) {
    const uint8_t* recs[1] = {packed + b * bytes};
    row_blocks<kRowBlockVnni>(M, [&](auto rows, int64_t m0) { block_vnni<Ymm, decltype(rows)::value, BITS, SUPER>(r, m0, recs, out, K, b); });
  }
}
#endif

}  // namespace

// Calls run(bits, super) with both as compile-time constants.
template <typename Run>
void with_layout(int64_t bits, bool super, Run&& run) {
  if (bits == 4)
    super ? run(std::integral_constant<int, 4>{}, std::true_type{}) : run(std::integral_constant<int, 4>{}, std::false_type{});
  else if (bits == 6)
    run(std::integral_constant<int, 6>{}, std::true_type{});
  else
    super ? run(std::integral_constant<int, 8>{}, std::true_type{}) : run(std::integral_constant<int, 8>{}, std::false_type{});
}

namespace {

// One product of a call, its arguments checked: packed blocks, their form, outputs and bias.
struct Product {
  const uint8_t* packed;
  int64_t bits;
  bool super;
  int64_t N;
  int64_t blocks;
  const float* bias;  // [N] or null
};

// `bias` contiguous (the callers make it so); `layer` names it in errors ("" for a single layer).
Product product_of(const torch::Tensor& packed, int64_t bits, bool super, int64_t N, const std::optional<torch::Tensor>& bias, int64_t K,
                   const std::string& layer) {
  TORCH_CHECK(bits == 4 || bits == 8 || (bits == 6 && super), "quantized_linear", layer, ": bits must be 4 or 8, or 6 with super-block scales");
  TORCH_CHECK(N > 0, "quantized_linear", layer, ": out_features must be positive, got ", N);
  const int64_t G = K / kGroup, blocks = (N + kBlock - 1) / kBlock;
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.dim() >= 2 && packed.size(0) == blocks &&
                  packed.numel() == blocks * block_bytes(bits, super, G),
              "quantized_linear", layer, ": packed uint8 [ceil(N/8), ...] with ", block_bytes(bits, super, G), " bytes per block expected");
  TORCH_CHECK(!bias || (bias->scalar_type() == torch::kFloat && bias->numel() == N), "quantized_linear", layer, ": bias [N] float32");
  return {packed.data_ptr<uint8_t>(), bits, super, N, blocks, bias ? bias->data_ptr<float>() : nullptr};
}

// The products of one input side by side: y [..., sum of their N]. The activations are quantized
// once for all of them, and the threads split all their output blocks in one parallel region, so
// a layer's projections that cannot share one packed tensor (other bits) still cost one call.
torch::Tensor products(const torch::Tensor& x_in, const std::vector<Product>& ps, int64_t isa) {
  const int64_t K = x_in.size(-1);
  if (isa == kBest) isa = best_isa();
  TORCH_CHECK(isa >= kPortable && isa <= best_isa(), "quantized_linear: path ", isa, " is not available on this CPU (best: ", best_isa(), ")");
  std::vector<int64_t> first{0}, offset{0};  // each product's first block and first output
  for (const Product& p : ps) {
    first.push_back(first.back() + p.blocks);
    offset.push_back(offset.back() + p.N);
  }
  const torch::Tensor x = x_in.contiguous();
  const int64_t M = x.numel() / K, total = offset.back();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = total;
  auto y = torch::empty(shape, x.options());
  if (M == 0) return y;
  const bool halves = std::any_of(ps.begin(), ps.end(), [](const Product& p) { return p.bits == 6; });
  const Rows rows = quantize_rows(x.data_ptr<float>(), M, K, isa >= kAvx2, halves);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, first.back(), 4, [&](int64_t b0, int64_t b1) {
    for (size_t i = 0; i < ps.size(); ++i) {
      const int64_t lo = std::max(b0, first[i]) - first[i], hi = std::min(b1, first[i + 1]) - first[i];
      if (lo >= hi) continue;
      const Product& p = ps[i];
      const Out out{yp + offset[i], total, p.N, p.bias};
      with_layout(p.bits, p.super, [&](auto b, auto s) {
        constexpr int BITS = decltype(b)::value;
        constexpr bool SUPER = decltype(s)::value;
#ifdef LEAPDECODE_X86
        if (isa == kAvx512Vnni) return blocks_vnni<BITS, SUPER>(rows, p.packed, out, M, K, lo, hi);
        if (isa == kAvx2) return blocks_avx2<BITS, SUPER>(rows, p.packed, out, M, K, lo, hi);
#endif
        blocks_portable(rows, p.packed, BITS, SUPER, out, M, K, lo, hi);
      });
    }
  });
  return y;
}

void check_input(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat, "quantized_linear: x [..., K] float32 expected");
  TORCH_CHECK(x.size(-1) > 0 && x.size(-1) % kGroup == 0, "quantized_linear: in_features must be a positive multiple of 32");
}

}  // namespace

// x [..., K] float32; packed uint8 [ceil(N/8), ...] holding each output block's records in
// block_bytes (see the top of this file; `super`: the super-block form of the scales); bias [N] or
// None. Returns [..., N]. `isa`: the path (kBest, kPortable, kAvx2, kAvx512Vnni); one this CPU
// cannot run is an error.
torch::Tensor quantized_linear(const torch::Tensor& x_in, const torch::Tensor& packed, int64_t bits, bool super, int64_t N,
                               const std::optional<torch::Tensor>& bias, int64_t isa) {
  check_input(x_in);
  const std::optional<torch::Tensor> b = bias ? std::optional<torch::Tensor>(bias->contiguous()) : std::nullopt;
  return products(x_in, {product_of(packed, bits, super, N, b, x_in.size(-1), "")}, isa);
}

// Several layers of one input (quantized_linear's arguments, one list entry a layer), their
// outputs side by side: [..., sum of N]. Each layer's columns are bitwise its own call's.
torch::Tensor quantized_linears(const torch::Tensor& x_in, const std::vector<torch::Tensor>& packed, const std::vector<int64_t>& bits,
                                const std::vector<int64_t>& super, const std::vector<int64_t>& N,
                                const std::vector<std::optional<torch::Tensor>>& bias, int64_t isa) {
  check_input(x_in);
  TORCH_CHECK(!packed.empty() && bits.size() == packed.size() && super.size() == packed.size() && N.size() == packed.size() &&
                  bias.size() == packed.size(),
              "quantized_linears: one packed tensor, bits, form, output count and bias (or None) a layer expected");
  std::vector<std::optional<torch::Tensor>> biases;  // contiguous, alive for the call
  std::vector<Product> ps;
  for (size_t i = 0; i < packed.size(); ++i) {
    biases.push_back(bias[i] ? std::optional<torch::Tensor>(bias[i]->contiguous()) : std::nullopt);
    ps.push_back(product_of(packed[i], bits[i], super[i] != 0, N[i], biases.back(), x_in.size(-1), " (layer " + std::to_string(i) + ")"));
  }
  return products(x_in, ps, isa);
}

// The activations as the kernel sees them (de-quantized): for reference checks.
torch::Tensor quantize_activations(torch::Tensor x, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) % kGroup == 0,
              "quantize_activations: x [M, K] float32 with K a multiple of 32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  const Rows r = quantize_rows(x.data_ptr<float>(), M, K, !portable && has_avx2_fma());
  auto out = torch::empty_like(x);
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < M * K; ++i) o[i] = static_cast<float>(r.q[i]) * r.d[i / kGroup % G + (i / K) * G];
  return out;
}

static bool fast_path_available() { return has_avx2_fma(); }

// A copy of `src` (contiguous, CPU) in memory aligned to 2 MiB and marked for transparent huge
// pages. A one-token pass streams every weight once: with 4 KiB pages its ~1 GB touches a quarter
// of a million pages, and the TLB misses cost several percent of the pass (measured on the 1.5B
// int4, one row). Where the system gives no huge pages (or not Linux), or `src` is under 2 MiB, it
// is a plain copy, no worse than the original. Freed with the tensor.
torch::Tensor huge_page_copy(const torch::Tensor& src) {
  TORCH_CHECK(src.device().is_cpu() && src.is_contiguous(), "huge_page_copy: a contiguous CPU tensor expected");
#if defined(_WIN32)
  return src.clone();
#else
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = src.nbytes();
  void* memory = nullptr;
  if (bytes < kHuge || posix_memalign(&memory, kHuge, bytes) != 0) return src.clone();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // The whole huge pages only: the tail stays in small pages rather than fill one of 2 MiB.
  madvise(memory, bytes / kHuge * kHuge, MADV_HUGEPAGE);  // advice only: refused, the pages stay small
#endif
  std::memcpy(memory, src.data_ptr(), bytes);
  return torch::from_blob(memory, src.sizes(), src.strides(), [](void* p) { std::free(p); }, src.options());
#endif
}

// Built into another extension (`lean.cpp`), this file gives its functions and no module of its own.
#ifndef LEAPDECODE_NO_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantized_linear", &quantized_linear, py::call_guard<py::gil_scoped_release>(), "group-quantized linear layer on packed blocks, rows bit-exact");
  m.def("quantized_linears", &quantized_linears, py::call_guard<py::gil_scoped_release>(), "several quantized layers of one input, their outputs side by side");
  m.def("quantize_activations", &quantize_activations, py::call_guard<py::gil_scoped_release>(), "activations as the quantized kernel sees them");
  m.def("fast_path_available", &fast_path_available, "whether the AVX2/FMA path runs on this CPU");
  m.def("huge_page_copy", &huge_page_copy, "a copy in 2 MiB-aligned memory marked for transparent huge pages");
  m.def("best_isa", &best_isa, "the fastest path this CPU runs: 0 portable, 1 AVX2, 2 AVX512-VNNI");
}
#endif
