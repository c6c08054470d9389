// The lean forward's decoder layers in one call (`models/lean.py`): for a pass of one sequence or several, what
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
std::vector<torch::Tensor> row_exact_attentions(const std::vector<torch::Tensor>& queries, const std::vector<torch::Tensor>& keys,
                                                const std::vector<torch::Tensor>& values,
                                                const std::vector<std::optional<torch::Tensor>>& visible, double scale, bool portable);

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

// x [N, hidden] float32: the embeddings of S sequences' tokens side by side, sequence s's
// `counts[s]` rows appended after its `lengths[s]` cached ones, each a chain (`visible[s]` None:
// each row attends causally) or a tree's nodes (`visible[s]` [n, length + n] bool: the keys each
// row may see, as `row_exact_attention` takes them; cos, sin at the nodes' depths). The products
// run over all N rows together; rotary, the cache writes and attention per sequence, over its own
// cache. Per layer, `weights` holds kParts tensors (the norms' weights and the linear layers'
// packed blocks, in the order above), `biases` kLinears (empty: none), `outs` their output counts
// and `bits`, `super` their packed forms (quant.cpp); `keys`, `values` per layer then per sequence
// (index layer * S + s) [1, kv_heads, capacity, dim] with capacity >= length + n: this call writes
// rows length .. length + n - 1. cos, sin [N, dim] at the rows' positions. Returns the last
// layer's output [N, hidden] (before the final norm).
torch::Tensor lean_layers(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights, const std::vector<torch::Tensor>& biases,
                          const std::vector<int64_t>& outs, const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                          const std::vector<int64_t>& lengths, const std::vector<int64_t>& counts, const torch::Tensor& cos_in,
                          const torch::Tensor& sin_in, const std::vector<std::optional<torch::Tensor>>& visible, int64_t heads,
                          int64_t kv_heads, double eps, double scale, const std::vector<int64_t>& bits, const std::vector<int64_t>& super,
                          int64_t isa) {
  const int64_t S = static_cast<int64_t>(lengths.size());
  TORCH_CHECK(S > 0 && static_cast<int64_t>(counts.size()) == S && static_cast<int64_t>(visible.size()) == S,
              "lean_layers: a length, a row count and a mask (or None) per sequence expected");
  TORCH_CHECK(keys.size() % S == 0, "lean_layers: one key and value buffer per layer and sequence expected");
  const int64_t layers = static_cast<int64_t>(keys.size()) / S;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kParts * layers && static_cast<int64_t>(biases.size()) == kLinears * layers &&
                  static_cast<int64_t>(outs.size()) == kLinears * layers && values.size() == keys.size() &&
                  bits.size() == outs.size() && super.size() == outs.size(),
              "lean_layers: ", kParts, " weights, ", kLinears, " biases, outputs and forms a layer, one key and value buffer a layer and sequence expected");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat, "lean_layers: x [N, hidden] float32 expected");
  const int64_t N = x_in.size(0), D = cos_in.size(-1), H = heads, KV = kv_heads;
  std::vector<int64_t> first(S + 1, 0);  // each sequence's first row
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(counts[s] > 0 && lengths[s] >= 0, "lean_layers: every sequence needs rows and a length >= 0");
    first[s + 1] = first[s] + counts[s];
  }
  TORCH_CHECK(first[S] == N, "lean_layers: the sequences' rows must add up to x's");
  const torch::Tensor cos = cos_in.reshape({N, D}).contiguous(), sin = sin_in.reshape({N, D}).contiguous();
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.sizes() == cos.sizes() && D % 2 == 0, "lean_layers: cos, sin [N, dim] float32 expected");
  torch::Tensor x = x_in.contiguous().clone();
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + kParts * l;
    const torch::Tensor* b = biases.data() + kLinears * l;
    const int64_t* Ns = outs.data() + kLinears * l;
    const int64_t* B = bits.data() + kLinears * l;
    const int64_t* Sp = super.data() + kLinears * l;
    TORCH_CHECK(Ns[0] + Ns[1] + Ns[2] == (H + 2 * KV) * D, "lean_layers: layer ", l, "'s projections do not fit the heads");
    for (int64_t s = 0; s < S; ++s) {
      const torch::Tensor &K = keys[l * S + s], &V = values[l * S + s];
      TORCH_CHECK(K.dim() == 4 && V.sizes() == K.sizes() && K.size(1) == KV && K.size(3) == D && K.size(2) >= lengths[s] + counts[s] &&
                      K.stride(3) == 1 && V.stride(3) == 1 && K.scalar_type() == torch::kFloat && V.scalar_type() == torch::kFloat,
                  "lean_layers: layer ", l, "'s cache buffers of sequence ", s, " do not fit");
    }
    // 1. attention: norm, the projections, rotary (queries to `q`, keys straight into each cache)
    const torch::Tensor qkv = products(rms_norm(x, w[0], eps, false), w + 1, b, Ns, B, Sp, 3, isa);  // [N, (H + 2 KV) D]
    torch::Tensor q = torch::empty({1, N, H, D}, x.options());
    const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    const int64_t width = (H + 2 * KV) * D;
    for (int64_t s = 0; s < S; ++s) {
      const torch::Tensor &K = keys[l * S + s], &V = values[l * S + s];
      float *kp = K.data_ptr<float>(), *vp = V.data_ptr<float>();
      for (int64_t r = first[s]; r < first[s + 1]; ++r) {
        const float* row = src + r * width;
        const int64_t at = lengths[s] + r - first[s];  // the row's place in its cache
        for (int64_t h = 0; h < H; ++h) rotate(row + h * D, cp + r * D, sp + r * D, qp + (r * H + h) * D, D);
        for (int64_t h = 0; h < KV; ++h) {
          rotate(row + (H + h) * D, cp + r * D, sp + r * D, kp + h * K.stride(1) + at * K.stride(2), D);
          std::memcpy(vp + h * V.stride(1) + at * V.stride(2), row + (H + KV + h) * D, D * sizeof(float));
        }
      }
    }
    // each sequence's rows over its own keys, as a pass of its own attends (one parallel region)
    std::vector<torch::Tensor> qs, ks, vs;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t end = lengths[s] + counts[s];
      qs.push_back(q.narrow(1, first[s], counts[s]).transpose(1, 2));  // [1, H, n, D]
      ks.push_back(keys[l * S + s].narrow(2, 0, end));
      vs.push_back(values[l * S + s].narrow(2, 0, end));
    }
    const std::vector<torch::Tensor> outs = row_exact_attentions(qs, ks, vs, visible, scale, false);  // each [1, n, H, D]
    const torch::Tensor seen = (S == 1 ? outs[0] : torch::cat(outs, 1)).reshape({N, H * D});
    x.add_(quantized_linear(seen, w[4], B[3], Sp[3] != 0, Ns[3], bias_of(b[3]), isa));
    // 2. the MLP: norm, gate and up, SiLU(gate) * up, down
    const torch::Tensor gate_up = products(rms_norm(x, w[5], eps, false), w + 6, b + 4, Ns + 4, B + 4, Sp + 4, 2, isa);
    const int64_t I = gate_up.size(1) / 2;
    const torch::Tensor act = at::mul(at::silu(gate_up.narrow(1, 0, I)), gate_up.narrow(1, I, I));
    x.add_(quantized_linear(act, w[8], B[6], Sp[6] != 0, Ns[6], bias_of(b[6]), isa));
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lean_layers", &lean_layers, py::call_guard<py::gil_scoped_release>(), "a Llama-family decoder's layers over the rows of one or several sequences, in one call");
  m.def("fast_path_available", &leapdecode::has_avx2_fma, "whether the AVX2/FMA paths of the kernels inside run on this CPU");
}
