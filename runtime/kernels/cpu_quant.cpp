// Weight-only int8 projections on the CPU: y = x @ (w * scale)^T + bias, the weight read as int8.
//
// A decode step is bound by reading the weights; held as int8 they are a quarter of float32's bytes, and the
// float weight is never written out whole. Output features are computed four at a time, each block of four
// weight rows read once for every input row while it sits in L1: with one input row (two with AVX-512) and
// one scale per output feature, straight from int8 (each row's sum scaled at the end); otherwise the block is
// first dequantized into a small float buffer, which four input rows at a time then read. Either way the
// sums run in another order than a float matmul's over the dequantized weight: results agree to float32
// rounding, not bit for bit. Blocks are split over torch's intra-op threads. float32 activations only; the
// loops are written for the compiler to vectorise (-O3 -march=native), with one scalar accumulator per (row,
// feature) so that it keeps each in a vector register, except one row alone, spelled out in AVX-512 or AVX2
// where the target has them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// Output features per task: enough int8 weight per task (a few tens of KB) that waking a thread pays.
constexpr int64_t kFeaturesPerTask = 32;
// Output features computed together: each input value is loaded once for all of them, and their sums are
// independent chains, which keeps the FMA units busy instead of waiting on one accumulator.
constexpr int64_t kFeatureBlock = 4;
// How far ahead of the block being computed the weight is prefetched: of 8, 24 and 64 KB ahead, 24 streamed
// fastest (x86-64-v4, 2 cores).
constexpr int64_t kPrefetchBytes = 24 * 1024;

// The dot products of Rows input rows (1 to 4) with kFeatureBlock weight rows (int8, or float already
// scaled) over columns [first, last): sums[row * kFeatureBlock + feature]. Plain scalar accumulators, so
// that the compiler vectorises the loop over the columns and keeps each sum in a vector register.
template <int Rows, typename Weight>
inline void dot_block(const float* x, int64_t x_stride, const Weight* w, int64_t w_stride, int64_t first,
                      int64_t last, float* sums) {
  const float* x0 = x;
  const float* x1 = x + (Rows > 1 ? x_stride : 0);
  const float* x2 = x + (Rows > 2 ? 2 * x_stride : 0);
  const float* x3 = x + (Rows > 3 ? 3 * x_stride : 0);
  const Weight* w0 = w;
  const Weight* w1 = w + w_stride;
  const Weight* w2 = w + 2 * w_stride;
  const Weight* w3 = w + 3 * w_stride;
  float a00 = 0.0f, a01 = 0.0f, a02 = 0.0f, a03 = 0.0f, a10 = 0.0f, a11 = 0.0f, a12 = 0.0f, a13 = 0.0f;
  float a20 = 0.0f, a21 = 0.0f, a22 = 0.0f, a23 = 0.0f, a30 = 0.0f, a31 = 0.0f, a32 = 0.0f, a33 = 0.0f;
#pragma omp simd reduction(+ : a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33)
  for (int64_t k = first; k < last; ++k) {
    const float v0 = w0[k], v1 = w1[k], v2 = w2[k], v3 = w3[k];
    const float in0 = x0[k];
    a00 += in0 * v0;
    a01 += in0 * v1;
    a02 += in0 * v2;
    a03 += in0 * v3;
    if constexpr (Rows > 1) {
      const float in1 = x1[k];
      a10 += in1 * v0;
      a11 += in1 * v1;
      a12 += in1 * v2;
      a13 += in1 * v3;
    }
    if constexpr (Rows > 2) {
      const float in2 = x2[k];
      a20 += in2 * v0;
      a21 += in2 * v1;
      a22 += in2 * v2;
      a23 += in2 * v3;
    }
    if constexpr (Rows > 3) {
      const float in3 = x3[k];
      a30 += in3 * v0;
      a31 += in3 * v1;
      a32 += in3 * v2;
      a33 += in3 * v3;
    }
  }
  const float all[4 * kFeatureBlock] = {a00, a01, a02, a03, a10, a11, a12, a13,
                                        a20, a21, a22, a23, a30, a31, a32, a33};
  for (int i = 0; i < Rows * kFeatureBlock; ++i) sums[i] = all[i];
}

// dot_block over float weights for any number of rows up to 4.
inline void dot_float_rows(int64_t rows, const float* x, int64_t in, const float* buffer, float* sums) {
  switch (rows) {
    case 1: return dot_block<1>(x, in, buffer, in, 0, in, sums);
    case 2: return dot_block<2>(x, in, buffer, in, 0, in, sums);
    case 3: return dot_block<3>(x, in, buffer, in, 0, in, sums);
    default: return dot_block<4>(x, in, buffer, in, 0, in, sums);
  }
}

// The dot products of one input row with kFeatureBlock int8 weight rows (a decode step of one sequence, the
// case most purely bound by reading the weights): sums[feature], unscaled. Spelled out in AVX-512 or AVX2,
// two independent chains per weight row. On one core the compiler's vectorisation of dot_block<1> read the
// int8 stream at about 9 GB/s, this at about 12 (x86-64-v4, where a plain streaming read reached 16 to 25).
// The loop is sensitive to its surroundings: the same loop called after the two-row path's dispatch (not
// before it) measured slower than the compiler's; keep the one-row case apart.
#if defined(__AVX512F__)
inline void dot_one_row(const float* x, const int8_t* w, int64_t in, float* sums) {
  __m512 acc[2 * kFeatureBlock];
  for (auto& a : acc) a = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
    const __m512 low = _mm512_loadu_ps(x + k);
    const __m512 high = _mm512_loadu_ps(x + k + 16);
    for (int f = 0; f < kFeatureBlock; ++f) {
      const int8_t* row = w + f * in + k;
      const __m512 w_low =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
      const __m512 w_high =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
      acc[2 * f] = _mm512_fmadd_ps(low, w_low, acc[2 * f]);
      acc[2 * f + 1] = _mm512_fmadd_ps(high, w_high, acc[2 * f + 1]);
    }
  }
  for (int f = 0; f < kFeatureBlock; ++f) {
    float tail = 0.0f;
    for (int64_t j = k; j < in; ++j) tail += x[j] * static_cast<float>(w[f * in + j]);
    sums[f] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * f], acc[2 * f + 1])) + tail;
  }
}
#elif defined(__AVX2__)
inline void dot_one_row(const float* x, const int8_t* w, int64_t in, float* sums) {
  __m256 acc[2 * kFeatureBlock];
  for (auto& a : acc) a = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= in; k += 16) {
    const __m256 low = _mm256_loadu_ps(x + k);
    const __m256 high = _mm256_loadu_ps(x + k + 8);
    for (int f = 0; f < kFeatureBlock; ++f) {
      const int8_t* row = w + f * in + k;
      const __m256 w_low =
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row))));
      const __m256 w_high =
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8))));
      acc[2 * f] = _mm256_fmadd_ps(low, w_low, acc[2 * f]);
      acc[2 * f + 1] = _mm256_fmadd_ps(high, w_high, acc[2 * f + 1]);
    }
  }
  for (int f = 0; f < kFeatureBlock; ++f) {
    float tail = 0.0f;
    for (int64_t j = k; j < in; ++j) tail += x[j] * static_cast<float>(w[f * in + j]);
    const __m256 both = _mm256_add_ps(acc[2 * f], acc[2 * f + 1]);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    sums[f] = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half))) + tail;
  }
}
#endif

// Output features [first, first + kFeatureBlock) of one or two rows, straight from the int8 weight with
// one scale per output feature: each row's sum is scaled once.
void features_from_int8(const float* x, int64_t rows, int64_t in, const int8_t* w, const float* scale,
                        int64_t first, float* totals) {
#if defined(__AVX512F__) || defined(__AVX2__)
  if (rows == 1) {
    dot_one_row(x, w + first * in, in, totals);
    for (int64_t i = 0; i < kFeatureBlock; ++i) totals[i] *= scale[first + i];
    return;
  }
#endif
  if (rows == 2) {
    dot_block<2>(x, in, w + first * in, in, 0, in, totals);
  } else {
    dot_block<1>(x, in, w + first * in, in, 0, in, totals);
  }
  for (int64_t i = 0; i < rows * kFeatureBlock; ++i) totals[i] *= scale[first + i % kFeatureBlock];
}

// The kFeatureBlock weight rows from `first` dequantized (int8 times scale) into `buffer` [kFeatureBlock, in].
// With more than two input rows, converting each weight once and reading floats after costs less than
// converting it again for every pair of rows; with group scales, it costs less than summing each group of a
// few hundred columns apart (each sum ends in a reduction across the vector's lanes).
void dequantize_block(const int8_t* w, const float* scale, int64_t in, int64_t groups, int64_t first,
                      float* buffer) {
  const int64_t group_size = in / groups;
  for (int64_t f = 0; f < kFeatureBlock; ++f) {
    const int8_t* w_row = w + (first + f) * in;
    float* out_row = buffer + f * in;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scale[(first + f) * groups + g];
      const int64_t begin = g * group_size;
#pragma omp simd
      for (int64_t k = begin; k < begin + group_size; ++k) out_row[k] = static_cast<float>(w_row[k]) * s;
    }
  }
}

// Input rows up to which a block is computed straight from int8. Two rows together measured faster that way
// with AVX-512; with AVX2 two rows took 1.2 to 1.7 times as long as three through the float buffer (the small
// model's projections on 2 threads), so there only the one-row loop reads int8.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t kStraightRows = 1;
#else
constexpr int64_t kStraightRows = 2;
#endif

// Whether a block is first dequantized into the float buffer: past kStraightRows rows, or with group scales.
inline bool reads_dequantized(int64_t rows, int64_t groups) { return rows > kStraightRows || groups > 1; }

// Output features [first, first + kFeatureBlock) of every row: y = x @ (w * scale)^T + bias.
void feature_block(const float* x, int64_t rows, int64_t in, const int8_t* w, const float* scale,
                   int64_t groups, const float* bias, int64_t first, float* buffer, float* y, int64_t out) {
  // The weight rows a few blocks ahead are fetched while this block computes: the hardware prefetcher
  // alone left the int8 stream at a third of the memory bandwidth.
  const int64_t ahead_features = std::max(kFeatureBlock, kPrefetchBytes / in / kFeatureBlock * kFeatureBlock);
  if (first + ahead_features + kFeatureBlock <= out) {
    const int8_t* ahead = w + (first + ahead_features) * in;
    for (int64_t byte = 0; byte < kFeatureBlock * in; byte += 64) __builtin_prefetch(ahead + byte);
  }
  const bool dequantized = reads_dequantized(rows, groups);
  if (dequantized) dequantize_block(w, scale, in, groups, first, buffer);
  // Rows taken together: up to two straight from int8 (more spill the vector registers), four from the
  // buffer.
  const int64_t step = dequantized ? 4 : kStraightRows;
  float totals[4 * kFeatureBlock];
  for (int64_t row = 0; row < rows; row += step) {
    const int64_t taken = std::min(step, rows - row);
    if (dequantized) {
      dot_float_rows(taken, x + row * in, in, buffer, totals);
    } else {
      features_from_int8(x + row * in, taken, in, w, scale, first, totals);
    }
    for (int64_t i = 0; i < taken * kFeatureBlock; ++i) {
      const int64_t feature = first + i % kFeatureBlock;
      y[(row + i / kFeatureBlock) * out + feature] = totals[i] + (bias != nullptr ? bias[feature] : 0.0f);
    }
  }
}

// x [rows, in] float32, weight [out, in] int8 (out a multiple of 4), scale [out, groups] float32 (groups
// divide `in`), bias [out] float32 or none -> [rows, out] float32.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kChar &&
                  scale.scalar_type() == at::kFloat,
              "int8_linear takes float32 x, int8 weight and float32 scale");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && scale.dim() == 2, "int8_linear: x, weight, scale are 2-D");
  const int64_t rows = x.size(0);
  const int64_t in = x.size(1);
  const int64_t out = weight.size(0);
  const int64_t groups = scale.size(1);
  TORCH_CHECK(weight.size(1) == in && scale.size(0) == out && groups > 0 && in % groups == 0,
              "int8_linear: shapes do not match");
  TORCH_CHECK(out % kFeatureBlock == 0, "int8_linear: output features must be a multiple of ", kFeatureBlock);
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
  const int64_t blocks = out / kFeatureBlock;
  at::parallel_for(0, blocks, kFeaturesPerTask / kFeatureBlock, [&](int64_t first_block, int64_t last_block) {
    std::vector<float> buffer(reads_dequantized(rows, groups) ? kFeatureBlock * in : 0);
    for (int64_t block = first_block; block < last_block; ++block) {
      feature_block(x_data, rows, in, w_data, s_data, groups, b_data, block * kFeatureBlock, buffer.data(), y,
                    out);
    }
  });
  return result;
}

}  // namespace

TORCH_LIBRARY(kvfleet_cpu_quant, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu_quant, CPU, m) { m.impl("int8_linear", &int8_linear); }
