// The lean forward's decoder layers in one call (`models/lean.py`): for a pass of one sequence, what
// transformers runs as ~40 torch ops and a dozen module calls a layer. Each small op between two
// weight streams pays for its code coming back into the caches (measured: 5-26 us an op after a
// layer's weights went through), so the layers run here, calling the same kernels as the model's
// own modules (built into this extension from `quant.cpp` and `row_exact.cpp`) and the same ATen
// ops where a float formula is ATen's own (SiLU): the scores are bitwise the model's own, which a
// backend checks before it takes this path (`engine/lean_pass.py`, `lean_agrees`).
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "simd.h"

torch::Tensor quantized_linear(const torch::Tensor& x_in, const torch::Tensor& packed, int64_t bits, bool super, int64_t N,
                               const std::optional<torch::Tensor>& bias, int64_t isa);
torch::Tensor quantized_linears(const torch::Tensor& x_in, const std::vector<torch::Tensor>& packed, const std::vector<int64_t>& bits,
                                const std::vector<int64_t>& super, const std::vector<int64_t>& N,
                                const std::vector<std::optional<torch::Tensor>>& bias, int64_t isa);
torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& weight, double eps, bool portable);
torch::Tensor row_exact_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                  const std::optional<torch::Tensor>& visible, double scale, bool portable);

namespace {

// Per layer, the weights: input norm, q (or q, k and v fused), k, v, o, post-attention norm, gate (or
// gate and up fused), up, down; a fused layer's k, v or up slot is empty. Its products: the same less
// the norms.
constexpr int64_t kParts = 9;
constexpr int64_t kLinears = 7;

// Rotary as transformers applies it, out = x * cos + rotate_half(x) * sin, rotate_half(x) =
// (-x[half:], x[:half]): each product and the sum rounded once, as its three tensor ops round them.
__attribute__((optimize("fp-contract=off"))) void rotate(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) out[j] = x[j] * c[j] + (-x[j + half]) * s[j];
  for (int64_t j = half; j < D; ++j) out[j] = x[j] * c[j] + x[j - half] * s[j];
}

std::optional<torch::Tensor> bias_of(const torch::Tensor& b) { return b.numel() ? std::optional<torch::Tensor>(b) : std::nullopt; }

// The products of `count` slots from `first` side by side (one fused product, or several in one
// call: one quantization of x, one parallel region).
torch::Tensor products(const torch::Tensor& x, const torch::Tensor* w, const torch::Tensor* b, const int64_t* N, const int64_t* B,
                       const int64_t* S, int count, int64_t isa) {
  std::vector<torch::Tensor> packed;
  std::vector<int64_t> bits, super, outs;
  std::vector<std::optional<torch::Tensor>> biases;
  for (int i = 0; i < count && (i == 0 || w[i].numel()); ++i) {
    packed.push_back(w[i]);
    bits.push_back(B[i]);
    super.push_back(S[i]);
    outs.push_back(N[i]);
    biases.push_back(bias_of(b[i]));
  }
  return quantized_linears(x, packed, bits, super, outs, biases, isa);
}

}  // namespace

// x [n, hidden] float32, the embeddings of n tokens appended after `length` cached ones: a chain
// (`visible` None: each row attends causally) or a tree's nodes (`visible` [n, length + n] bool:
// the keys each row may see, as `row_exact_attention` takes them; cos, sin at the nodes' depths). Per layer, `weights` holds kParts tensors (the norms' weights and the
// linear layers' packed blocks, in the order above), `biases` kLinears (empty: none), `outs` their
// output counts and `bits`, `super` their packed forms (quant.cpp);
// `keys`, `values` [1, kv_heads, capacity, dim] with capacity >= length + n: this call writes rows
// length .. length + n - 1. cos, sin [n, dim] at the rows' positions. Returns the last layer's
// output [n, hidden] (before the final norm).
torch::Tensor lean_layers(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights, const std::vector<torch::Tensor>& biases,
                          const std::vector<int64_t>& outs, const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                          int64_t length, const torch::Tensor& cos_in, const torch::Tensor& sin_in,
                          const std::optional<torch::Tensor>& visible, int64_t heads, int64_t kv_heads,
                          double eps, double scale, const std::vector<int64_t>& bits, const std::vector<int64_t>& super,
                          int64_t isa) {
  const int64_t layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kParts * layers && static_cast<int64_t>(biases.size()) == kLinears * layers &&
                  static_cast<int64_t>(outs.size()) == kLinears * layers && static_cast<int64_t>(values.size()) == layers &&
                  bits.size() == outs.size() && super.size() == outs.size(),
              "lean_layers: ", kParts, " weights, ", kLinears, " biases, outputs and forms, one key and value buffer a layer expected");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat, "lean_layers: x [n, hidden] float32 expected");
  const int64_t n = x_in.size(0), D = cos_in.size(-1), H = heads, KV = kv_heads;
  const torch::Tensor cos = cos_in.reshape({n, D}).contiguous(), sin = sin_in.reshape({n, D}).contiguous();
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.sizes() == cos.sizes() && D % 2 == 0, "lean_layers: cos, sin [n, dim] float32 expected");
  torch::Tensor x = x_in.contiguous().clone();
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + kParts * l;
    const torch::Tensor* b = biases.data() + kLinears * l;
    const int64_t* N = outs.data() + kLinears * l;
    const int64_t* B = bits.data() + kLinears * l;
    const int64_t* S = super.data() + kLinears * l;
    const torch::Tensor &K = keys[l], &V = values[l];
    TORCH_CHECK(N[0] + N[1] + N[2] == (H + 2 * KV) * D && K.dim() == 4 && V.sizes() == K.sizes() && K.size(1) == KV &&
                    K.size(3) == D && K.size(2) >= length + n && K.stride(3) == 1 && V.stride(3) == 1 &&
                    K.scalar_type() == torch::kFloat && V.scalar_type() == torch::kFloat,
                "lean_layers: layer ", l, "'s projections or cache buffers do not fit");
    // 1. attention: norm, the projections, rotary (queries to `q`, keys straight into the cache)
    const torch::Tensor qkv = products(rms_norm(x, w[0], eps, false), w + 1, b, N, B, S, 3, isa);  // [n, (H + 2 KV) D]
    torch::Tensor q = torch::empty({1, n, H, D}, x.options());
    const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    float *qp = q.data_ptr<float>(), *kp = K.data_ptr<float>(), *vp = V.data_ptr<float>();
    const int64_t width = (H + 2 * KV) * D;
    for (int64_t r = 0; r < n; ++r) {
      const float* row = src + r * width;
      for (int64_t h = 0; h < H; ++h) rotate(row + h * D, cp + r * D, sp + r * D, qp + (r * H + h) * D, D);
      for (int64_t h = 0; h < KV; ++h) {
        rotate(row + (H + h) * D, cp + r * D, sp + r * D, kp + h * K.stride(1) + (length + r) * K.stride(2), D);
        std::memcpy(vp + h * V.stride(1) + (length + r) * V.stride(2), row + (H + KV + h) * D, D * sizeof(float));
      }
    }
    const torch::Tensor seen = row_exact_attention(q.transpose(1, 2), K.narrow(2, 0, length + n), V.narrow(2, 0, length + n),
                                                   visible, scale, false);  // [1, n, H, D]
    x.add_(quantized_linear(seen.reshape({n, H * D}), w[4], B[3], S[3] != 0, N[3], bias_of(b[3]), isa));
    // 2. the MLP: norm, gate and up, SiLU(gate) * up, down
    const torch::Tensor gate_up = products(rms_norm(x, w[5], eps, false), w + 6, b + 4, N + 4, B + 4, S + 4, 2, isa);
    const int64_t I = gate_up.size(1) / 2;
    const torch::Tensor act = at::mul(at::silu(gate_up.narrow(1, 0, I)), gate_up.narrow(1, I, I));
    x.add_(quantized_linear(act, w[8], B[6], S[6] != 0, N[6], bias_of(b[6]), isa));
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lean_layers", &lean_layers, "a Llama-family decoder's layers over a few rows of one sequence, in one call");
  m.def("fast_path_available", &leapdecode::has_avx2_fma, "whether the AVX2/FMA paths of the kernels inside run on this CPU");
}
