// Group-quantized linear layers: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// Weights are stored in groups of 32 along k (GGUF's block size): int8 with a scale per group
// (w = d * q, GGUF's Q8_0), or 4-bit with a scale and a minimum per group (w = d * q + min, q in
// 0..15; Q4_0, Q4_1 and Q4_K all fit). Activations are quantized at run time, per row and group, to
// int8 with their own scale (as llama.cpp does), so each group's dot product is an exact integer
// sum computed 32 products at a time (AVX2 `maddubs`), and only the per-group scaling is float.
//
// Row-exact by construction, like row_exact.cpp: a weight group is unpacked once and used for up
// to 8 rows, but each row keeps its own accumulators, its own order over groups and its own final
// sum, so row i of an M-row call is bit-identical to a 1-row call on that row. The portable path
// emulates the AVX2 path's eight lanes and its horizontal sum, so both give the same bits. Threads
// split the outputs (n), never the reduction.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

using leapdecode::has_avx2_fma;
#ifdef LEAPDECODE_X86
using leapdecode::hsum;
#endif

constexpr int64_t kGroup = 32;  // weights (and activations) per group along k
constexpr int kLanes = 8;       // float accumulators per row (one AVX2 register)
constexpr int kRowBlock = 8;    // rows sharing one unpacking of each weight group

// M rows of activations quantized per group: q = round(x / d), d = max|x| / 127.
struct Rows {
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d;   // [M, G]
  std::vector<float> s;   // [M, G] d * sum(q): the group's sum as the products see it
};

Rows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / kGroup;
  Rows r{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* xs = x + m * K + g * kGroup;
      float amax = 0.f;
      for (int j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(xs[j]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      for (int j = 0; j < kGroup; ++j) {
        const int32_t v = std::clamp(static_cast<int32_t>(std::nearbyint(xs[j] * inv)), -127, 127);
        r.q[m * K + g * kGroup + j] = static_cast<int8_t>(v);
        sum += v;
      }
      r.d[m * G + g] = d;
      r.s[m * G + g] = d * static_cast<float>(sum);
    }
  return r;
}

// The AVX2 path's horizontal sum of eight lanes, in its order.
inline float lanes_sum(const float* v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

// sum_g mins[g] * s[g], as the AVX2 path computes it (eight lanes over whole octets, then the rest).
inline float min_term_portable(const float* mins, const float* s, int64_t G) {
  float lane[kLanes] = {0};
  int64_t g = 0;
  for (; g + kLanes <= G; g += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] = std::fma(mins[g + j], s[g + j], lane[j]);
  float t = lanes_sum(lane);
  for (; g < G; ++g) t = std::fma(mins[g], s[g], t);
  return t;
}

// Portable path: integer products per lane (elements 4j..4j+3 of a group go to lane j, as
// `maddubs` + `madd` pair them), then the same float steps as the AVX2 path.
void rows_portable(const Rows& r, const uint8_t* wq, const float* wd, const float* wmin, int bits, const float* bias,
                   float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup, bytes = bits == 4 ? kGroup / 2 : kGroup;
  int32_t w[kGroup];
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc[kLanes] = {0};
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* b = wq + (n * G + g) * bytes;
        for (int j = 0; j < kGroup; ++j)
          w[j] = bits == 4 ? (j < 16 ? b[j] & 0x0F : b[j - 16] >> 4) : static_cast<int8_t>(b[j]);
        const int8_t* xq = r.q.data() + m * K + g * kGroup;
        const float scale = wd[n * G + g] * r.d[m * G + g];
        for (int j = 0; j < kLanes; ++j) {
          int32_t dot = 0;
          for (int e = 4 * j; e < 4 * j + 4; ++e) dot += w[e] * xq[e];
          acc[j] = std::fma(static_cast<float>(dot), scale, acc[j]);
        }
      }
      float out = lanes_sum(acc);
      if (wmin) out += min_term_portable(wmin + n * G, r.s.data() + m * G, G);
      y[m * N + n] = bias ? out + bias[n] : out;
    }
}

#ifdef LEAPDECODE_X86
__attribute__((target("avx2,fma"))) inline float min_term_avx2(const float* mins, const float* s, int64_t G) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + kLanes <= G; g += kLanes) acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(s + g), acc);
  float t = hsum(acc);
  for (; g < G; ++g) t = std::fma(mins[g], s[g], t);
  return t;
}

// NB weight rows (outputs n..n+NB-1) against MB rows of x; both are compile-time constants so the
// NB x MB accumulators live in registers (several independent chains: one row alone is not
// latency-bound). Each (output, row) chain is the same instruction sequence whatever NB and MB.
template <int NB, int MB, int BITS>
__attribute__((target("avx2,fma"))) inline void block_avx2(const Rows& r, int64_t m0, const uint8_t* wq, const float* wd,
                                                           const float* wmin, const float* bias, float* y, int64_t N,
                                                           int64_t K, int64_t n) {
  const int64_t G = K / kGroup, bytes = BITS == 4 ? kGroup / 2 : kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 acc[NB][MB];
  for (int o = 0; o < NB; ++o)
    for (int i = 0; i < MB; ++i) acc[o][i] = _mm256_setzero_ps();
  const int8_t* xq = r.q.data() + m0 * K;
  const float* xd = r.d.data() + m0 * G;
  for (int64_t g = 0; g < G; ++g) {
    __m256i w[NB];        // unsigned magnitudes (int4: q itself; int8: |q|, signs moved onto x)
    __m256i wsigned[NB];  // int8 only
    __m256 dw[NB];
    for (int o = 0; o < NB; ++o) {
      const uint8_t* b = wq + ((n + o) * G + g) * bytes;
      if constexpr (BITS == 4) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
        w[o] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
      } else {
        wsigned[o] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
        w[o] = _mm256_sign_epi8(wsigned[o], wsigned[o]);
      }
      dw[o] = _mm256_broadcast_ss(wd + (n + o) * G + g);
    }
    for (int i = 0; i < MB; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + g * kGroup));
      const __m256 dx = _mm256_broadcast_ss(xd + i * G + g);
      for (int o = 0; o < NB; ++o) {
        const __m256i xs = BITS == 8 ? _mm256_sign_epi8(xv, wsigned[o]) : xv;
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w[o], xs), ones);
        acc[o][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw[o], dx), acc[o][i]);
      }
    }
  }
  for (int o = 0; o < NB; ++o)
    for (int i = 0; i < MB; ++i) {
      float out = hsum(acc[o][i]);
      if (wmin) out += min_term_avx2(wmin + (n + o) * G, r.s.data() + (m0 + i) * G, G);
      y[(m0 + i) * N + n + o] = bias ? out + bias[n + o] : out;
    }
}

// Outputs n0..n1 for all M rows: rows in blocks of up to 8; few rows take several outputs at once.
template <int BITS>
__attribute__((target("avx2,fma"))) void rows_avx2(const Rows& r, const uint8_t* wq, const float* wd, const float* wmin,
                                                   const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                                                   int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t mb = std::min<int64_t>(kRowBlock, M - m0);
    const int64_t nb = mb <= 2 ? 4 : mb <= 4 ? 2 : 1;
    int64_t n = n0;
    for (; n + nb <= n1; n += nb) {
      switch (mb) {
        case 1: block_avx2<4, 1, BITS>(r, m0, wq, wd, wmin, bias, y, N, K, n); break;
        case 2: block_avx2<4, 2, BITS>(r, m0, wq, wd, wmin, bias, y, N, K, n); break;
        case 3: block_avx2<2, 3, BITS>(r, m0, wq, wd, wmin, bias, y, N, K, n); break;
        case 4: block_avx2<2, 4, BITS>(r, m0, wq, wd, wmin, bias, y, N, K, n); break;
        case 5: block_avx2<1, 5, BITS>(r, m0, wq, wd, wmin, bias, y, N, K, n); break;
        case 6: block_avx2<1, 6, BITS>(r, m0, wq, wd, wmin, bias, y, N, K, n); break;
        case 7: block_avx2<1, 7, BITS>(r, m0, wq, wd, wmin, bias, y, N, K, n); break;
        default: block_avx2<1, 8, BITS>(r, m0, wq, wd, wmin, bias, y, N, K, n); break;
      }
    }
    for (; n < n1; ++n) {  // the outputs left over when n1 - n0 is not a multiple of nb
      switch (mb) {
        case 1: block_avx2<1, 1, BITS>(r, m0, wq, wd, wmin, bias, y, N, K, n); break;
        case 2: block_avx2<1, 2, BITS>(r, m0, wq, wd, wmin, bias, y, N, K, n); break;
        case 3: block_avx2<1, 3, BITS>(r, m0, wq, wd, wmin, bias, y, N, K, n); break;
        default: block_avx2<1, 4, BITS>(r, m0, wq, wd, wmin, bias, y, N, K, n); break;
      }
    }
  }
}
#endif

}  // namespace

// x [M, K] float32; qweight uint8 [N, K/2] (bits 4: byte j of a group holds q[j] low, q[j+16]
// high) or int8-as-uint8 [N, K] (bits 8); scales [N, K/32]; mins [N, K/32] (bits 4) or empty;
// bias [N] or empty. `portable` forces the portable path.
torch::Tensor quantized_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins,
                               torch::Tensor bias, int64_t bits, bool portable) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized_linear: bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "quantized_linear: x [M, K] float32 expected");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, "quantized_linear: in_features must be a multiple of 32");
  TORCH_CHECK(qweight.scalar_type() == torch::kByte && qweight.dim() == 2 && qweight.size(1) == K * bits / 8,
              "quantized_linear: qweight [N, K*bits/8] uint8 expected");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.numel() == N * G, "quantized_linear: scales [N, K/32] float32");
  TORCH_CHECK(bits == 8 || (mins.scalar_type() == torch::kFloat && mins.numel() == N * G),
              "quantized_linear: 4-bit weights need mins [N, K/32] float32");
  x = x.contiguous();
  qweight = qweight.contiguous();
  scales = scales.contiguous();
  const Rows rows = quantize_rows(x.data_ptr<float>(), M, K);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wq = qweight.data_ptr<uint8_t>();
  const float* wd = scales.data_ptr<float>();
  torch::Tensor mins_c = bits == 4 ? mins.contiguous() : mins;
  const float* wmin = bits == 4 ? mins_c.data_ptr<float>() : nullptr;
  torch::Tensor bias_c = bias.numel() ? bias.contiguous() : bias;
  const float* bp = bias.numel() ? bias_c.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const bool fast = !portable && has_avx2_fma();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
#ifdef LEAPDECODE_X86
    if (fast) {
      if (bits == 4)
        rows_avx2<4>(rows, wq, wd, wmin, bp, yp, M, N, K, n0, n1);
      else
        rows_avx2<8>(rows, wq, wd, wmin, bp, yp, M, N, K, n0, n1);
      return;
    }
#endif
    rows_portable(rows, wq, wd, wmin, static_cast<int>(bits), bp, yp, M, N, K, n0, n1);
  });
  return y;
}

// The activations as the kernel sees them (de-quantized): for reference checks.
torch::Tensor quantize_activations(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) % kGroup == 0,
              "quantize_activations: x [M, K] float32 with K a multiple of 32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  const Rows r = quantize_rows(x.data_ptr<float>(), M, K);
  auto out = torch::empty_like(x);
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < M * K; ++i) o[i] = static_cast<float>(r.q[i]) * r.d[i / kGroup % G + (i / K) * G];
  return out;
}

bool fast_path_available() { return has_avx2_fma(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantized_linear", &quantized_linear, "group-quantized linear layer, rows bit-exact");
  m.def("quantize_activations", &quantize_activations, "activations as the quantized kernel sees them");
  m.def("fast_path_available", &fast_path_available, "whether the AVX2/FMA path runs on this CPU");
}
