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
#include <optional>
#include <vector>

#include "simd.h"

namespace {

using leapdecode::has_avx2_fma;
#ifdef LEAPDECODE_X86
using leapdecode::hsum;
#endif

constexpr int kRowBlock = 8;  // rows sharing one load of each weight chunk: 8 independent FMA chains

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

__attribute__((target("avx2,fma"))) void rows_avx2(const float* x, const float* w, const float* bias, float* y,
                                                   int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
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

// Attention of one query row over the keys it may see. The dot products (8 lanes over the head
// dimension, then `lanes_sum`, then the tail) and the weighted sum of values (one fma per element,
// keys in cache order) run the same sequence on both paths, so the portable path gives the same
// bits; and nothing depends on how many rows the call scores.
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

void axpy_portable(float* out, float e, const float* v, int64_t D) {
  for (int64_t d = 0; d < D; ++d) out[d] = std::fma(e, v[d], out[d]);
}

#ifdef LEAPDECODE_X86
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  float s = hsum(acc);
  for (; d < D; ++d) s = std::fma(a[d], b[d], s);
  return s;
}

__attribute__((target("avx2,fma"))) void axpy_avx2(float* out, float e, const float* v, int64_t D) {
  const __m256 ev = _mm256_set1_ps(e);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(out + d, _mm256_fmadd_ps(ev, _mm256_loadu_ps(v + d), _mm256_loadu_ps(out + d)));
  for (; d < D; ++d) out[d] = std::fma(e, v[d], out[d]);
}
#endif

}  // namespace

// query [1, H, Q, D]; key, value [1, Hkv, T, D] (any strides but the last, e.g. views of a longer
// cache); visible [Q, T] bool, or None: causal, the queries being the last Q positions. Returns
// [1, Q, H, D]: softmax(scale * q.k) over each row's visible keys, times their values.
torch::Tensor row_exact_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                  const std::optional<torch::Tensor>& visible, double scale, bool portable) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1 && key.size(0) == 1 &&
                  value.size(0) == 1, "row_exact_attention: [1, heads, length, dim] tensors expected");
  TORCH_CHECK(query.scalar_type() == torch::kFloat && key.scalar_type() == torch::kFloat && value.scalar_type() == torch::kFloat,
              "row_exact_attention: float32 only");
  const int64_t H = query.size(1), Q = query.size(2), D = query.size(3), Hkv = key.size(1), T = key.size(2);
  TORCH_CHECK(key.size(3) == D && value.size(1) == Hkv && value.size(2) == T && value.size(3) == D && Hkv > 0 && H % Hkv == 0,
              "row_exact_attention: key/value shapes do not fit the query");
  TORCH_CHECK(T >= Q, "row_exact_attention: fewer keys than queries");
  const torch::Tensor q = query.contiguous();
  const torch::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const torch::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  torch::Tensor mask;
  if (visible) {
    TORCH_CHECK(visible->scalar_type() == torch::kBool && visible->dim() == 2 && visible->size(0) == Q && visible->size(1) == T,
                "row_exact_attention: visible [queries, keys] bool expected");
    mask = visible->contiguous();
  }
  auto out = torch::empty({1, Q, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = visible ? mask.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t ks1 = k.stride(1), ks2 = k.stride(2), vs1 = v.stride(1), vs2 = v.stride(2), group = H / Hkv;
  const float sc = static_cast<float>(scale);
  float (*dot)(const float*, const float*, int64_t) = dot_portable;  // chosen once: both give the same bits
  void (*axpy)(float*, float, const float*, int64_t) = axpy_portable;
#ifdef LEAPDECODE_X86
  if (!portable && has_avx2_fma()) {
    dot = dot_avx2;
    axpy = axpy_avx2;
  }
#endif
  at::parallel_for(0, H * Q, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> weights(T);
    std::vector<int64_t> keys(T);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / Q, i = t % Q, kvh = h / group;
      const float* qr = qp + (h * Q + i) * D;
      int64_t n = 0;
      for (int64_t j = 0; j < T; ++j) {
        if (mp ? !mp[i * T + j] : j > T - Q + i) continue;
        const float* kr = kp + kvh * ks1 + j * ks2;
        weights[n] = dot(qr, kr, D) * sc;
        keys[n++] = j;
      }
      float* orow = op + (i * H + h) * D;
      std::fill(orow, orow + D, 0.f);
      if (n == 0) continue;  // a row that sees nothing (never in a decode pass): zeros, not NaN
      const float top = *std::max_element(weights.begin(), weights.begin() + n);
      float total = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        weights[j] = std::exp(weights[j] - top);
        total += weights[j];
      }
      for (int64_t j = 0; j < n; ++j) axpy(orow, weights[j], vp + kvh * vs1 + keys[j] * vs2, D);
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) orow[d] *= inv;
    }
  });
  return out;
}

// x [M, K], w [N, K], bias [N] or empty; float32, contiguous. `portable` forces the scalar path.
torch::Tensor row_exact_linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias, bool portable) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "row_exact_linear: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "row_exact_linear: float32 only");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.numel() ? bias.contiguous().data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const bool fast = !portable && has_avx2_fma();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
#ifdef LEAPDECODE_X86
    if (fast) {
      rows_avx2(xp, wp, bp, yp, M, N, K, n0, n1);
      return;
    }
#endif
    rows_portable(xp, wp, bp, yp, M, N, K, n0, n1);
  });
  return y;
}

bool fast_path_available() { return has_avx2_fma(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_exact_linear", &row_exact_linear, "row-exact linear (float32)");
  m.def("row_exact_attention", &row_exact_attention, "attention, each query row over its visible keys, rows bit-exact");
  m.def("fast_path_available", &fast_path_available, "whether the AVX2/FMA path runs on this CPU");
}
