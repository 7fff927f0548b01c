// The small layer operations between a CPU step's projections, each one pass over its rows in one call.
//
// In torch each is several operations on tensors of a few thousand floats (RMSNorm with its residual add is
// five, the rotary embedding four), so a decode step pays the dispatch and the memory traffic of each. Here
// a row is read once and written once. Rows are split over torch's intra-op threads only when there are
// enough of them (prefill): a decode step's few rows cost less than waking the threads. float32 only; the
// loops are written for the compiler to vectorise (-O3 -march=native).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

// Rows per thread below which a call runs on the calling thread alone.
constexpr int64_t kRowsPerThread = 16;

// norm(x + residual) * weight and x + residual (or norm(x) * weight and x): the two layer inputs of RMSNorm
// with the residual stream, accumulated in float32 as Transformers' float32 RMSNorm does.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                           const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm takes float32");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.numel() == hidden, "rms_norm: weight has ", weight.numel(), " values, rows ", hidden);
  const at::Tensor input = x.contiguous();
  const int64_t rows = input.numel() / hidden;
  at::Tensor out = at::empty_like(input);
  at::Tensor summed = input;
  // Held here, not as temporaries, so that the pointers below stay valid when a copy had to be made.
  at::Tensor residual_rows;
  const at::Tensor weight_values = weight.contiguous();
  const float* added = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat,
                "rms_norm: residual must match x");
    summed = at::empty_like(input);
    residual_rows = residual->contiguous();
    added = residual_rows.data_ptr<float>();
  }
  const float* in = input.data_ptr<float>();
  const float* w = weight_values.data_ptr<float>();
  float* sum_out = summed.data_ptr<float>();
  float* normed = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowsPerThread, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const float* in_row = in + row * hidden;
      float* sum_row = sum_out + row * hidden;
      if (added != nullptr) {
        const float* added_row = added + row * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) sum_row[i] = in_row[i] + added_row[i];
      }
      const float* source = added != nullptr ? sum_row : in_row;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < hidden; ++i) squares += source[i] * source[i];
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + epsilon);
      float* out_row = normed + row * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) out_row[i] = source[i] * scale * w[i];
    }
  });
  return {out.view(x.sizes()), summed.view(x.sizes())};
}

// Turns the heads of one token in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), halves of head_dim.
inline void rotate_heads(float* token, int64_t heads, int64_t head_stride, int64_t half, const float* cos,
                         const float* sin) {
  for (int64_t head = 0; head < heads; ++head) {
    float* x1 = token + head * head_stride;
    float* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i];
      const float b = x2[i];
      x1[i] = a * cos[i] - b * sin[i];
      x2[i] = b * cos[i] + a * sin[i];
    }
  }
}

// Rotates query [tokens, heads, head_dim] and key [tokens, kv_heads, head_dim] in place (views into the fused
// QKV output: any token and head strides, the last dimension contiguous) by the cos_sin_cache rows
// [positions, head_dim] (cos then sin, each head_dim / 2 wide) that `rows` [tokens] names.
void rotary_embedding(const at::Tensor& rows, const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  cos_sin_cache.scalar_type() == at::kFloat,
              "rotary_embedding takes float32");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1,
              "rotary_embedding: query and key must be [tokens, heads, head_dim] with contiguous heads");
  const int64_t tokens = query.size(0);
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(key.size(0) == tokens && key.size(2) == head_dim && cos_sin_cache.size(1) == head_dim &&
                  head_dim % 2 == 0,
              "rotary_embedding: shapes do not match");
  const at::Tensor row_ids = rows.to(at::kLong).contiguous();
  const at::Tensor cache = cos_sin_cache.contiguous();
  const int64_t* row_of = row_ids.data_ptr<int64_t>();
  const float* table = cache.data_ptr<float>();
  const int64_t table_rows = cache.size(0);
  float* q = query.data_ptr<float>();
  float* k = key.data_ptr<float>();
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, kRowsPerThread, [&](int64_t first, int64_t last) {
    for (int64_t token = first; token < last; ++token) {
      const int64_t row = row_of[token];
      TORCH_CHECK(row >= 0 && row < table_rows, "rotary_embedding: position ", row, " is past the table");
      const float* cos = table + row * head_dim;
      rotate_heads(q + token * query.stride(0), query.size(1), query.stride(1), half, cos, cos + half);
      rotate_heads(k + token * key.stride(0), key.size(1), key.stride(1), half, cos, cos + half);
    }
  });
}

// SwiGLU on the fused [..., 2 * intermediate] projection: silu(gate) * up, with ATen's vectorised SiLU.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const auto halves = gate_up.chunk(2, -1);
  return at::silu(halves[0]).mul_(halves[1]);
}

}  // namespace

TORCH_LIBRARY(kvfleet_cpu_layers, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_embedding_(Tensor rows, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu_layers, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_embedding_", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
