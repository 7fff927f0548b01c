// Weight-only int8 projections on the CPU: y = x @ (w * scale)^T + bias, the weight read as int8.
//
// A decode step is bound by reading the weights; held as int8 they are a quarter of float32's bytes, and the
// float weight is never written out whole. The weight is packed at load in blocks of output features as wide
// as one float32 vector (16 with AVX-512, else 8; `feature_block()` says which), column by column:
// [out / width, in, width], so that one load of `width` bytes, sign-extended and converted, is one vector of
// the block's weights at one input column. Each input row's value at that column is broadcast and multiplied
// into the row's vector of sums: no reduction across a vector's lanes, and the weight is converted once for
// every row of the call. Rows go together in tiles of up to eight (R rows by F blocks of features, R * F
// vector sums kept in registers); a tile sums each group of columns apart and adds it times the group's
// scales, packed alike [out / width, groups, width]. Feature blocks are split over torch's intra-op threads.
// The sums run in another order than a float matmul's over the dequantized weight: results agree to float32
// rounding, not bit for bit. float32 activations only.
//
// Against the layout it replaced ([out, in], four features at a time, rows past one read through a
// dequantized float buffer), the `small` model's 32 projections on 2 threads of an AVX2 CPU took 1.2 to 1.4
// times less time at one row and 1.7 to 2.8 times less at two to sixteen. On 2 threads of an AVX-512 Xeon,
// blocks of sixteen features took 1.2 times less time than blocks of eight at one row, 1.3 to 1.5 times less
// at two to four, and 1.7 to 2.1 times less at eight to sixty-four.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Output features in a packed block: one vector of float32.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
// Rows a tile takes at most.
constexpr int64_t kTileRows = 8;
// Feature blocks per task: enough int8 weight per task (tens of KB) that waking a thread pays.
constexpr int64_t kBlocksPerTask = 4;

typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));

// A block's weights at one column, as floats.
inline Floats load_weights(const int8_t* p) {
#if defined(__AVX512F__)
  return (Floats)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (Floats)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef int8_t Bytes __attribute__((vector_size(kLanes)));
  Bytes bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  return __builtin_convertvector(bytes, Floats);
#endif
}

inline Floats load_floats(const float* p) {
  Floats values;
  std::memcpy(&values, p, sizeof(values));
  return values;
}

// Rows [0, R) of x against feature blocks [0, F) from `w` (each block `block_bytes` on): y's R rows at
// features [first_feature, first_feature + F * 8).
template <int R, int F>
inline void tile(const float* x, int64_t in, const int8_t* w, int64_t block_bytes, const float* scale,
                 int64_t groups, const float* bias, float* y, int64_t out, int64_t first_feature) {
  const int64_t group_size = in / groups;
  Floats total[R][F] = {};
  for (int64_t g = 0; g < groups; ++g) {
    Floats sums[R][F] = {};
    for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
      Floats weights[F];
      for (int f = 0; f < F; ++f) weights[f] = load_weights(w + f * block_bytes + k * kLanes);
      for (int r = 0; r < R; ++r) {
        const float value = x[r * in + k];
        for (int f = 0; f < F; ++f) sums[r][f] += value * weights[f];
      }
    }
    for (int f = 0; f < F; ++f) {
      const Floats group_scale = load_floats(scale + (f * groups + g) * kLanes);
      for (int r = 0; r < R; ++r) total[r][f] += sums[r][f] * group_scale;
    }
  }
  for (int f = 0; f < F; ++f) {
    const Floats added = bias != nullptr ? load_floats(bias + first_feature + f * kLanes) : Floats{};
    for (int r = 0; r < R; ++r) {
      const Floats result = total[r][f] + added;
      std::memcpy(y + r * out + first_feature + f * kLanes, &result, sizeof(result));
    }
  }
}

// R rows against feature blocks [first_block, last_block), F blocks to a tile: enough independent chains
// of sums to keep the FMA units busy, and with a group's sums beside the running totals, no more than the
// registers hold: about eight with AVX2's sixteen, sixteen with AVX-512's thirty-two.
template <int R>
void rows_against_blocks(const float* x, int64_t in, const int8_t* w, const float* scale, int64_t groups,
                         const float* bias, float* y, int64_t out, int64_t first_block, int64_t last_block) {
#if defined(__AVX512F__)
  constexpr int F = R <= 2 ? 8 : R <= 4 ? 4 : 2;
#else
  constexpr int F = R <= 2 ? 4 : R <= 4 ? 2 : 1;
#endif
  const int64_t block_bytes = in * kLanes;
  int64_t block = first_block;
  for (; block + F <= last_block; block += F) {
    tile<R, F>(x, in, w + block * block_bytes, block_bytes, scale + block * groups * kLanes, groups, bias, y,
               out, block * kLanes);
  }
  for (; block < last_block; ++block) {
    tile<R, 1>(x, in, w + block * block_bytes, block_bytes, scale + block * groups * kLanes, groups, bias, y,
               out, block * kLanes);
  }
}

void rows_against_blocks(int64_t rows, const float* x, int64_t in, const int8_t* w, const float* scale,
                         int64_t groups, const float* bias, float* y, int64_t out, int64_t first_block,
                         int64_t last_block) {
  switch (rows) {
    case 1: return rows_against_blocks<1>(x, in, w, scale, groups, bias, y, out, first_block, last_block);
    case 2: return rows_against_blocks<2>(x, in, w, scale, groups, bias, y, out, first_block, last_block);
    case 3: return rows_against_blocks<3>(x, in, w, scale, groups, bias, y, out, first_block, last_block);
    case 4: return rows_against_blocks<4>(x, in, w, scale, groups, bias, y, out, first_block, last_block);
    case 5: return rows_against_blocks<5>(x, in, w, scale, groups, bias, y, out, first_block, last_block);
    case 6: return rows_against_blocks<6>(x, in, w, scale, groups, bias, y, out, first_block, last_block);
    case 7: return rows_against_blocks<7>(x, in, w, scale, groups, bias, y, out, first_block, last_block);
    default: return rows_against_blocks<8>(x, in, w, scale, groups, bias, y, out, first_block, last_block);
  }
}

// x [rows, in] float32, weight [out / width, in, width] int8, scale [out / width, groups, width] float32
// (groups divide `in`), bias [out] float32 or none -> [rows, out] float32.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kChar &&
                  scale.scalar_type() == at::kFloat,
              "int8_linear takes float32 x, int8 weight and float32 scale");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && scale.dim() == 3 && weight.size(2) == kLanes &&
                  scale.size(2) == kLanes,
              "int8_linear: x is [rows, in], weight and scale packed [out / ", kLanes, ", in or groups, ",
              kLanes, "]");
  const int64_t rows = x.size(0);
  const int64_t in = x.size(1);
  const int64_t blocks = weight.size(0);
  const int64_t out = blocks * kLanes;
  const int64_t groups = scale.size(1);
  TORCH_CHECK(weight.size(1) == in && scale.size(0) == blocks && groups > 0 && in % groups == 0,
              "int8_linear: shapes do not match");
  const at::Tensor input = x.contiguous();
  const at::Tensor w = weight.contiguous();
  const at::Tensor s = scale.contiguous();
  at::Tensor bias_values;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == out && bias->scalar_type() == at::kFloat, "int8_linear: bias must be [out]");
    bias_values = bias->contiguous();
  }
  at::Tensor result = at::empty({rows, out}, x.options());
  const float* x_data = input.data_ptr<float>();
  const int8_t* w_data = w.data_ptr<int8_t>();
  const float* s_data = s.data_ptr<float>();
  const float* b_data = bias_values.defined() ? bias_values.data_ptr<float>() : nullptr;
  float* y = result.data_ptr<float>();
  at::parallel_for(0, blocks, kBlocksPerTask, [&](int64_t first_block, int64_t last_block) {
    // A task's weight blocks stay in cache while tile after tile of rows reads them.
    for (int64_t row = 0; row < rows; row += kTileRows) {
      rows_against_blocks(std::min(kTileRows, rows - row), x_data + row * in, in, w_data, s_data, groups, b_data,
                          y + row * out, out, first_block, last_block);
    }
  });
  return result;
}

// A mixture-of-experts layer's int8 projections: x's rows in consecutive groups, sizes[e] rows for
// weights[e] and scales[e] (each packed as int8_linear's, all of one shape), no bias -> [rows, out]. One
// parallel region over every expert's feature blocks, where a call per expert would wait for its threads at
// each expert's end.
at::Tensor int8_grouped_linear(const at::Tensor& x, at::TensorList weights, at::TensorList scales,
                               at::IntArrayRef sizes) {
  const int64_t experts = static_cast<int64_t>(sizes.size());
  TORCH_CHECK(experts > 0 && static_cast<int64_t>(weights.size()) == experts &&
                  static_cast<int64_t>(scales.size()) == experts,
              "int8_grouped_linear takes a weight, a scale and a size for each expert");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "int8_grouped_linear: x is float32 [rows, in]");
  const int64_t in = x.size(1);
  const int64_t blocks = weights[0].size(0);
  const int64_t out = blocks * kLanes;
  const int64_t groups = scales[0].size(1);
  TORCH_CHECK(groups > 0 && in % groups == 0, "int8_grouped_linear: the groups must divide the input columns");
  std::vector<const int8_t*> w_data(experts);
  std::vector<const float*> s_data(experts);
  std::vector<int64_t> first_row(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    const at::Tensor& w = weights[e];
    const at::Tensor& s = scales[e];
    TORCH_CHECK(w.scalar_type() == at::kChar && s.scalar_type() == at::kFloat && w.is_contiguous() &&
                    s.is_contiguous(),
                "int8_grouped_linear: contiguous int8 weights and float32 scales");
    TORCH_CHECK(w.dim() == 3 && w.size(0) == blocks && w.size(1) == in && w.size(2) == kLanes && s.dim() == 3 &&
                    s.size(0) == blocks && s.size(1) == groups && s.size(2) == kLanes,
                "int8_grouped_linear: every expert's weight is packed [", blocks, ", ", in, ", ", kLanes,
                "] and its scale [", blocks, ", ", groups, ", ", kLanes, "]");
    TORCH_CHECK(sizes[e] >= 0, "int8_grouped_linear: negative size");
    w_data[e] = w.data_ptr<int8_t>();
    s_data[e] = s.data_ptr<float>();
    first_row[e + 1] = first_row[e] + sizes[e];
  }
  TORCH_CHECK(first_row[experts] == x.size(0), "int8_grouped_linear: the sizes must add up to x's rows");
  const at::Tensor input = x.contiguous();
  at::Tensor result = at::empty({x.size(0), out}, x.options());
  const float* x_data = input.data_ptr<float>();
  float* y = result.data_ptr<float>();
  // Task t is feature block t % blocks of expert t / blocks; a task range is cut where an expert ends.
  at::parallel_for(0, experts * blocks, kBlocksPerTask, [&](int64_t first_task, int64_t last_task) {
    for (int64_t task = first_task; task < last_task;) {
      const int64_t e = task / blocks;
      const int64_t first_block = task % blocks;
      const int64_t last_block = std::min(blocks, first_block + last_task - task);
      for (int64_t row = first_row[e]; row < first_row[e + 1]; row += kTileRows) {
        rows_against_blocks(std::min(kTileRows, first_row[e + 1] - row), x_data + row * in, in, w_data[e],
                            s_data[e], groups, nullptr, y + row * out, out, first_block, last_block);
      }
      task += last_block - first_block;
    }
  });
  return result;
}

// The width of a packed block of output features.
int64_t feature_block() { return kLanes; }

}  // namespace

TORCH_LIBRARY(kvfleet_cpu_quant, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int8_grouped_linear(Tensor x, Tensor[] weights, Tensor[] scales, int[] sizes) -> Tensor");
  m.def("feature_block() -> int", &feature_block);
}

TORCH_LIBRARY_IMPL(kvfleet_cpu_quant, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_grouped_linear", &int8_grouped_linear);
}
