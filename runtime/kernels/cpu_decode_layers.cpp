// A Llama-family model's decoder layers for a CPU decode step, all in one call.
//
// A decode step of a small batch reads every weight once and computes little else; between the projections,
// each layer is a dozen operations called from Python (the norms, the split of Q/K/V, the rotary embedding,
// the KV write, attention, SwiGLU) and its modules' dispatch, and with int8 weights that overhead outweighed
// the projections themselves. Here the layers' weights are held once, and a step runs every layer's
// operations from C++: the same operations, in the same order and on the same inputs as the model's Python
// forward, so the results are bit for bit the same. The operations are the project's own (the int8 matmul,
// the layer operations, the paged decode attention kernel) and oneDNN's float32 matmul, called through
// torch's dispatcher; the project's libraries must be loaded before the first step.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using MaybeTensor = std::optional<at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const MaybeTensor& bias) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const MaybeTensor&)>("kvfleet_cpu_quant::int8_linear");
  return op.call(x, weight, scale, bias);
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const MaybeTensor& residual,
                                            const at::Tensor& weight, double eps) {
  static const auto op =
      find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const MaybeTensor&, const at::Tensor&, double)>(
          "kvfleet_cpu_layers::rms_norm");
  return op.call(x, residual, weight, eps);
}

void rotary_embedding(const at::Tensor& rows, const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& cos_sin_cache) {
  static const auto op = find_op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "kvfleet_cpu_layers::rotary_embedding_");
  op.call(rows, query, key, cos_sin_cache);
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  static const auto op = find_op<at::Tensor(const at::Tensor&)>("kvfleet_cpu_layers::silu_and_mul");
  return op.call(gate_up);
}

void paged_decode_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& decode_rows,
                            const at::Tensor& decode_requests, double scale, int64_t sliding_window) {
  static const auto op =
      find_op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t)>(
          "kvfleet_cpu::paged_decode_attention");
  op.call(out, query, key_cache, value_cache, block_tables, seq_lens, decode_rows, decode_requests, scale,
          sliding_window);
}

// A float32 projection through oneDNN, as `Linear.forward` runs it: the weight packed by
// `mkldnn::_reorder_linear_weight` (else a plain one, through aten::linear), and an input of fewer rows than
// `padding` has, plus one, padded with its zero rows.
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight, const MaybeTensor& bias,
                        const MaybeTensor& padding) {
  if (!weight.is_mkldnn()) return at::linear(x, weight, bias);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t rows = x.size(0);
  const bool padded = padding.has_value() && rows <= padding->size(0);
  const at::Tensor input = padded ? at::cat({x, padding->narrow(0, 0, padding->size(0) + 1 - rows)}) : x;
  torch::jit::Stack stack{input, weight, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::string("")};
  op.callBoxed(&stack);
  const at::Tensor out = stack[0].toTensor();
  return padded ? out.narrow(0, 0, rows) : out;
}

// A projection: int8 packed for `int8_linear` (`Int8Linear` after `pack_for_cpu`), with its scales, or
// float32 for `float_linear`.
struct Projection {
  at::Tensor weight;    // int8 [out / width, in, width], or float32 (oneDNN's packed or plain) [out, in]
  MaybeTensor scale;    // int8 only: float32 [out / width, groups, width]
  MaybeTensor bias;     // float32 [out]
  MaybeTensor padding;  // oneDNN's only: `Linear.padding_rows`

  at::Tensor operator()(const at::Tensor& x) const {
    return scale.has_value() ? int8_linear(x, weight, *scale, bias) : float_linear(x, weight, bias, padding);
  }
};

struct Layer {
  at::Tensor input_norm;
  at::Tensor post_attention_norm;
  MaybeTensor q_norm;  // Qwen3's per-head norms of query and key
  MaybeTensor k_norm;
  Projection qkv;
  Projection o;
  Projection gate_up;
  Projection down;
  int64_t sliding_window;  // 0: none
};

// The decoder layers of one model; `add_layer` once per layer in order, then `forward` every decode step.
struct DecoderLayers : torch::CustomClassHolder {
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  double eps;
  double attention_scale;
  std::vector<Layer> layers;

  DecoderLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double attention_scale)
      : num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim), eps(eps),
        attention_scale(attention_scale) {}

  // Each projection is [weight, scale, bias, padding]: its scale for int8 weights, else none; its bias or
  // none; the zero rows a float one pads a shorter input with (`float_linear`), or none.
  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, MaybeTensor q_norm, MaybeTensor k_norm,
                 c10::List<MaybeTensor> qkv, c10::List<MaybeTensor> o, c10::List<MaybeTensor> gate_up,
                 c10::List<MaybeTensor> down, int64_t sliding_window) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "add_layer: q_norm and k_norm come together");
    layers.push_back(Layer{input_norm, post_attention_norm, q_norm, k_norm, projection(qkv, "qkv"),
                           projection(o, "o"), projection(gate_up, "gate_up"), projection(down, "down"),
                           sliding_window});
  }

  // hidden [tokens, hidden_size], the embedded decode tokens, one per request, and the step's inputs as the
  // model's forward has them: the rotary embedding's rows of cos_sin_cache, each layer's KV cache
  // [2, blocks, block_size, kv_heads, head_dim], and the decodes the attention kernel attends (every token
  // of the step). Returns the last layer's (hidden, residual), for the model's final norm.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, at::Tensor rotary_rows, at::Tensor cos_sin_cache,
                                             std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping,
                                             at::Tensor block_tables, at::Tensor seq_lens, at::Tensor decode_rows,
                                             at::Tensor decode_requests) const {
    TORCH_CHECK(kv_caches.size() == layers.size(), "forward: one KV cache per layer");
    const int64_t tokens = hidden.size(0);
    const int64_t q_size = num_heads * head_dim;
    const int64_t kv_size = num_kv_heads * head_dim;
    MaybeTensor residual;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& layer = layers[i];
      const at::Tensor& kv_cache = kv_caches[i];
      auto [normed, summed] = rms_norm(hidden, residual, layer.input_norm, eps);
      const at::Tensor qkv = layer.qkv(normed);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
      if (layer.q_norm.has_value()) {
        q = std::get<0>(rms_norm(q, std::nullopt, *layer.q_norm, eps));
        k = std::get<0>(rms_norm(k, std::nullopt, *layer.k_norm, eps));
      }
      rotary_embedding(rotary_rows, q, k, cos_sin_cache);
      const int64_t row = kv_size;
      kv_cache.select(0, 0).view({-1, row}).index_copy_(0, slot_mapping, k.reshape({-1, row}));
      kv_cache.select(0, 1).view({-1, row}).index_copy_(0, slot_mapping, v.reshape({-1, row}));
      const at::Tensor attended = at::empty({tokens, num_heads, head_dim}, q.options());
      paged_decode_attention(attended, q, kv_cache.select(0, 0), kv_cache.select(0, 1), block_tables, seq_lens,
                             decode_rows, decode_requests, attention_scale, layer.sliding_window);
      auto [mlp_input, mlp_residual] = rms_norm(layer.o(attended.view({tokens, q_size})), summed,
                                                layer.post_attention_norm, eps);
      hidden = layer.down(silu_and_mul(layer.gate_up(mlp_input)));
      residual = mlp_residual;
    }
    TORCH_CHECK(residual.has_value(), "forward: a model has at least one layer");
    return {hidden, *residual};
  }

 private:
  static Projection projection(const c10::List<MaybeTensor>& parts, const char* name) {
    TORCH_CHECK(parts.size() == 4 && parts.get(0).has_value(), "add_layer: ", name,
                " is [weight, scale, bias, padding]");
    const at::Tensor weight = *parts.get(0);
    const MaybeTensor scale = parts.get(1);
    TORCH_CHECK(scale.has_value() == (weight.scalar_type() == at::kChar),
                "add_layer: ", name, " has a scale if and only if its weight is int8");
    return Projection{weight, scale, parts.get(2), parts.get(3)};
  }
};

}  // namespace

TORCH_LIBRARY(kvfleet_cpu_decode, m) {
  m.class_<DecoderLayers>("DecoderLayers")
      .def(torch::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &DecoderLayers::add_layer)
      .def("forward", &DecoderLayers::forward);
}
