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
#include <cstdint>

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

}  // namespace

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
  m.def("fast_path_available", &fast_path_available, "whether the AVX2/FMA path runs on this CPU");
}
