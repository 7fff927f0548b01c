// A Llama-family model's decoder layers for a CPU decode step with int8 projections, all in one call.
//
// Once the projections read a quarter of float32's bytes, a batch-1 decode step of the `small` model spends
// more time between them than in them: each layer is a dozen operations called from Python (the norms, the
// split of Q/K/V, the rotary embedding, the KV write, attention, SwiGLU) and its modules' dispatch, and that
// overhead outweighs the operations' own work. Here the layers' weights are held once, and a step runs every
// layer's operations from C++: the same operations, in the same order and on the same inputs as the model's
// Python forward, so the results are bit for bit the same. The operations are the project's own (the int8
// matmul, the layer operations, the paged decode attention kernel), called through torch's dispatcher; their
// libraries must be loaded before the first step.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
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

// A packed int8 projection (`Int8Linear` after `pack_for_cpu`).
struct Projection {
  at::Tensor weight;  // int8 [out / width, in, width]
  at::Tensor scale;   // float32 [out / width, groups, width]
  MaybeTensor bias;   // float32 [out]

  at::Tensor operator()(const at::Tensor& x) const { return int8_linear(x, weight, scale, bias); }
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
struct Int8DecoderLayers : torch::CustomClassHolder {
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  double eps;
  double attention_scale;
  std::vector<Layer> layers;

  Int8DecoderLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double attention_scale)
      : num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim), eps(eps),
        attention_scale(attention_scale) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, MaybeTensor q_norm, MaybeTensor k_norm,
                 std::vector<at::Tensor> qkv, std::vector<at::Tensor> o, at::Tensor gate_up_weight,
                 at::Tensor gate_up_scale, at::Tensor down_weight, at::Tensor down_scale, int64_t sliding_window) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "add_layer: q_norm and k_norm come together");
    layers.push_back(Layer{input_norm, post_attention_norm, q_norm, k_norm, projection(qkv, "qkv"),
                           projection(o, "o"), Projection{gate_up_weight, gate_up_scale, std::nullopt},
                           Projection{down_weight, down_scale, std::nullopt}, sliding_window});
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
  // [weight, scale] or [weight, scale, bias].
  static Projection projection(const std::vector<at::Tensor>& parts, const char* name) {
    TORCH_CHECK(parts.size() == 2 || parts.size() == 3, "add_layer: ", name, " is [weight, scale(, bias)]");
    return Projection{parts[0], parts[1], parts.size() == 3 ? MaybeTensor(parts[2]) : std::nullopt};
  }
};

}  // namespace

TORCH_LIBRARY(kvfleet_cpu_decode, m) {
  m.class_<Int8DecoderLayers>("Int8DecoderLayers")
      .def(torch::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &Int8DecoderLayers::add_layer)
      .def("forward", &Int8DecoderLayers::forward);
}
