// A Llama-family model's decoder layers for a CPU decode step, all in one call; a mixture-of-experts model's
// sparse layers with their router and experts.
//
// A decode step of a small batch reads every weight once and computes little else; between the projections,
// each layer is a dozen operations called from Python (the norms, the split of Q/K/V, the rotary embedding,
// the KV write, attention, SwiGLU) and its modules' dispatch, and with int8 weights that overhead outweighed
// the projections themselves. Here the layers' weights are held once, and a step runs every layer's
// operations from C++: the same operations, in the same order and on the same inputs as the model's Python
// forward, so the results are bit for bit the same. The operations are the project's own (the int8 matmuls,
// the layer operations, the paged decode attention kernel), oneDNN's float32 matmul and torch's grouped one,
// called through torch's dispatcher; the project's libraries must be loaded before the first step.

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

at::Tensor int8_grouped_linear(const at::Tensor& x, at::TensorList weights, at::TensorList scales,
                               at::IntArrayRef sizes) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, at::TensorList, at::TensorList, at::IntArrayRef)>(
      "kvfleet_cpu_quant::int8_grouped_linear");
  return op.call(x, weights, scales, sizes);
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

// x's rows in consecutive groups, sizes[e] rows for expert e, each group times weight[e] transposed (weight
// [experts, out, in]), as `moe.GroupedLinear` runs it on the CPU: torch's grouped matmul, which the layers
// are bound for only where their strides fit it (`moe.grouped_mm_fits`).
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight, const std::vector<int64_t>& sizes) {
  std::vector<int32_t> ends(sizes.size());
  int32_t end = 0;
  for (size_t e = 0; e < sizes.size(); ++e) ends[e] = end += static_cast<int32_t>(sizes[e]);
  const at::Tensor offsets = at::tensor(ends, at::TensorOptions().dtype(at::kInt));
  return at::_grouped_mm(x, weight.transpose(1, 2), offsets);
}

// A dense layer's SwiGLU MLP (`llama.LlamaMLP`).
struct DenseMlp {
  Projection gate_up;
  Projection down;

  at::Tensor operator()(const at::Tensor& x) const { return down(silu_and_mul(gate_up(x))); }
};

// A sparse layer's router and experts (`moe.SparseMoeBlock` on one rank that holds every expert): each token
// goes to its top_k experts by the router's softmax, the token-expert pairs run sorted by expert, each
// expert's rows in one matmul, and each token sums its pairs' weighted outputs. The experts are float32,
// stacked (`moe.FusedMoE`: gate_up [experts, 2 x intermediate, hidden], down [experts, hidden, intermediate]),
// or int8, one packed projection each (`moe.Int8Experts`), of which only those routed to run.
struct SparseMlp {
  Projection router;
  int64_t top_k;
  bool norm_topk_prob;
  at::Tensor expert_tokens;  // int64 [experts]: the block's count of the pairs routed to each, added to here
  std::vector<at::Tensor> gate_up;  // float32: the stack; int8: each expert's
  std::vector<at::Tensor> down;
  std::vector<at::Tensor> gate_up_scales;  // int8 only
  std::vector<at::Tensor> down_scales;

  at::Tensor operator()(const at::Tensor& hidden) const {
    const int64_t tokens = hidden.size(0);
    const int64_t experts = expert_tokens.size(0);
    auto [weights, chosen] = at::softmax(router(hidden), -1, at::kFloat).topk(top_k, -1);
    if (norm_topk_prob) weights.div_(weights.sum(-1, true));
    const at::Tensor flat = chosen.flatten();
    const at::Tensor counts = at::bincount(flat, std::nullopt, experts);
    expert_tokens.add_(counts);
    const int64_t* count = counts.data_ptr<int64_t>();
    const std::vector<int64_t> sizes(count, count + experts);
    const at::Tensor pairs = flat.argsort();  // by expert
    const at::Tensor by_expert = hidden.index_select(0, pairs.div(top_k, "floor"));
    const at::Tensor scaled = expert_mlp(by_expert, sizes) * weights.flatten().index_select(0, pairs).unsqueeze(1);
    // Each pair's output in its place among its token's top_k, then summed per token.
    const at::Tensor by_pair = at::zeros({tokens * top_k, hidden.size(1)}, hidden.options());
    by_pair.index_copy_(0, pairs, scaled);
    return by_pair.view({tokens, top_k, -1}).sum(1);
  }

 private:
  at::Tensor expert_mlp(const at::Tensor& x, const std::vector<int64_t>& sizes) const {
    if (gate_up_scales.empty()) {
      return grouped_linear(silu_and_mul(grouped_linear(x, gate_up[0], sizes)), down[0], sizes);
    }
    std::vector<at::Tensor> w13, s13, w2, s2;  // the routed experts' (the others' weights are not read)
    std::vector<int64_t> rows;
    for (size_t e = 0; e < sizes.size(); ++e) {
      if (sizes[e] == 0) continue;
      w13.push_back(gate_up[e]);
      s13.push_back(gate_up_scales[e]);
      w2.push_back(down[e]);
      s2.push_back(down_scales[e]);
      rows.push_back(sizes[e]);
    }
    return int8_grouped_linear(silu_and_mul(int8_grouped_linear(x, w13, s13, rows)), w2, s2, rows);
  }
};

struct Layer {
  at::Tensor input_norm;
  at::Tensor post_attention_norm;
  MaybeTensor q_norm;  // Qwen3's per-head norms of query and key
  MaybeTensor k_norm;
  Projection qkv;
  Projection o;
  int64_t sliding_window;  // 0: none
  std::optional<DenseMlp> dense;  // one of the two, once given
  std::optional<SparseMlp> sparse;

  at::Tensor mlp(const at::Tensor& x) const { return dense.has_value() ? (*dense)(x) : (*sparse)(x); }
};

// The decoder layers of one model: `add_layer` once per layer in order, each followed by its MLP
// (`add_dense_mlp` or `add_sparse_mlp`), then `forward` every decode step.
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
                 c10::List<MaybeTensor> qkv, c10::List<MaybeTensor> o, int64_t sliding_window) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "add_layer: q_norm and k_norm come together");
    TORCH_CHECK(layers.empty() || has_mlp(layers.back()), "add_layer: the previous layer has no MLP");
    layers.push_back(Layer{input_norm, post_attention_norm, q_norm, k_norm, projection(qkv, "qkv"),
                           projection(o, "o"), sliding_window, std::nullopt, std::nullopt});
  }

  void add_dense_mlp(c10::List<MaybeTensor> gate_up, c10::List<MaybeTensor> down) {
    last_layer_without_mlp("add_dense_mlp").dense = DenseMlp{projection(gate_up, "gate_up"), projection(down, "down")};
  }

  // The router's projection as the others; expert_tokens the block's own buffer. Float32 experts: gate_up
  // and down their stacks, no scales; int8 ones: each expert's packed weight and its scales.
  void add_sparse_mlp(c10::List<MaybeTensor> router, int64_t top_k, bool norm_topk_prob, at::Tensor expert_tokens,
                      std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
                      std::vector<at::Tensor> gate_up_scales, std::vector<at::Tensor> down_scales) {
    const size_t experts = static_cast<size_t>(expert_tokens.size(0));
    const bool stacked = gate_up_scales.empty() && down_scales.empty() && gate_up.size() == 1 && down.size() == 1;
    const bool one_by_one = gate_up.size() == experts && down.size() == experts &&
                            gate_up_scales.size() == experts && down_scales.size() == experts;
    TORCH_CHECK(stacked || one_by_one,
                "add_sparse_mlp: float32 experts come stacked, int8 ones one by one with their scales");
    TORCH_CHECK(expert_tokens.scalar_type() == at::kLong && 0 < top_k && top_k <= static_cast<int64_t>(experts),
                "add_sparse_mlp: expert_tokens is int64 [experts], and top_k at most that many");
    last_layer_without_mlp("add_sparse_mlp").sparse =
        SparseMlp{projection(router, "router"), top_k, norm_topk_prob, expert_tokens, gate_up, down,
                  gate_up_scales, down_scales};
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
    TORCH_CHECK(!layers.empty() && has_mlp(layers.back()), "forward: the last layer has no MLP");
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
      hidden = layer.mlp(mlp_input);
      residual = mlp_residual;
    }
    return {hidden, *residual};
  }

 private:
  static bool has_mlp(const Layer& layer) { return layer.dense.has_value() || layer.sparse.has_value(); }

  Layer& last_layer_without_mlp(const char* method) {
    TORCH_CHECK(!layers.empty() && !has_mlp(layers.back()), method, ": add_layer first, then its one MLP");
    return layers.back();
  }

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
      .def("add_dense_mlp", &DecoderLayers::add_dense_mlp)
      .def("add_sparse_mlp", &DecoderLayers::add_sparse_mlp)
      .def("forward", &DecoderLayers::forward);
}
