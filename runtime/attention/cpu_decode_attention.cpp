// Paged decode attention on the CPU: one query token per request, read from the paged KV cache in place.
//
// A work item is one (request, KV head): the query heads that share the KV head are handled together, so
// each key and value row is read from memory once. The item walks its context in tiles of one vector's width
// of positions through the request's block table row, from the first position its sliding window sees (if
// any) to its end, with an online softmax in float32: per tile, each query head's scores, then its running
// maximum, sum and output rescaled once and the tile's values added. Rows a few tiles ahead are prefetched
// while a tile is computed, since a request's blocks lie anywhere in the cache. Items are handed to torch's
// intra-op threads one at a time, since contexts differ in length.
//
// Vectors are GCC's generic vector types as wide as the host's registers: 16 floats with AVX-512, 8 without.
// A vector twice a register's width is split by the compiler, and some of its operations (a scalar broadcast
// among them) then go through the stack: on an AVX2 EPYC, 16-float vectors made the kernel four times slower.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#ifdef __AVX512F__
constexpr int64_t kLanes = 16;  // positions per tile, floats per vector
constexpr int kVectorRegisters = 32;
#else
constexpr int64_t kLanes = 8;
constexpr int kVectorRegisters = 16;
#endif
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxChunks = kMaxHeadDim / kLanes;
constexpr int64_t kMaxGroup = 64;  // query heads per KV head
using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using IntVec = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec broadcast(float x) {
  Vec v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = x;
  return v;
}

// exp(x) for x <= 0 in plain arithmetic, to within a few ulp, a vector at a time. Below -87 the result underflows
// float32 anyway (so -inf, an empty running maximum, gives a negligible 1e-38).
inline Vec exp_nonpositive(Vec x) {
  x = x < -87.0f ? broadcast(-87.0f) : x;
  const Vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  Vec r = x - n * 0.693145751953125f;  // x - n ln 2, with ln 2 split in two for accuracy
  r = r - n * 1.428606765330187045e-06f;
  // exp(r) for |r| <= ln(2) / 2: its Taylor series to r^7 (error below 1e-8, relative).
  Vec p = broadcast(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const IntVec exponent = (__builtin_convertvector(n, IntVec) + 127) << 23;  // 2^n
  return p * (Vec)exponent;
}

#ifdef __AVX512F__
inline float max_lanes(Vec v) {
  Vec w = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v > w ? v : w;
  w = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v = v > w ? v : w;
  w = __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  v = v > w ? v : w;
  return std::max(v[0], v[1]);
}

inline float sum_lanes(Vec v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  return v[0] + v[1];
}

// The 16 sums of lanes of 16 vectors, as one vector: a tree of shuffles and adds, each level halving the
// number of vectors and doubling the positions each one holds (45 operations, not 16 reductions of 15).
inline Vec sum_lanes_of_each(Vec (&d)[kLanes]) {
  for (int64_t i = 0; i < 8; ++i) {
    d[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int64_t i = 0; i < 4; ++i) {
    d[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int64_t i = 0; i < 2; ++i) {
    d[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
inline float max_lanes(Vec v) {
  Vec w = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v = v > w ? v : w;
  w = __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1);
  v = v > w ? v : w;
  return std::max(v[0], v[1]);
}

inline float sum_lanes(Vec v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1);
  return v[0] + v[1];
}

// The 8 sums of lanes of 8 vectors, as one vector, by the same tree on 8 lanes (21 operations).
inline Vec sum_lanes_of_each(Vec (&d)[kLanes]) {
  for (int64_t i = 0; i < 4; ++i) {
    d[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int64_t i = 0; i < 2; ++i) {
    d[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

template <typename scalar_t>
inline Vec load_vector(const scalar_t* p) {
  Vec v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

template <>
inline Vec load_vector<float>(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

struct DecodeShape {
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t query_row_stride;  // elements between query rows
  int64_t out_row_stride;
  int64_t cache_block_stride;  // elements between blocks of the key (and value) cache
  int64_t block_table_stride;
  float scale;
  int64_t sliding_window;  // 0: none
};

// Where a request's context positions lie in the cache, position after position, without a division each.
class RowWalker {
 public:
  RowWalker(const DecodeShape& shape, const int32_t* block_table, int64_t position, int64_t kv_head)
      : shape_(shape),
        block_table_(block_table),
        block_(position / shape.block_size),
        offset_in_block_(position % shape.block_size),
        head_offset_(kv_head * shape.head_dim) {}

  int64_t next() {
    const int64_t row = block_table_[block_] * shape_.cache_block_stride +
                        offset_in_block_ * shape_.num_kv_heads * shape_.head_dim + head_offset_;
    if (++offset_in_block_ == shape_.block_size) {
      offset_in_block_ = 0;
      ++block_;
    }
    return row;
  }

 private:
  const DecodeShape& shape_;
  const int32_t* block_table_;
  int64_t block_;
  int64_t offset_in_block_;
  int64_t head_offset_;
};

// The cache offsets of a tile's rows. Positions outside [first, end) take the last visible row before
// them (or the first one), so that nothing outside the context is read; their scores are masked.
inline void tile_rows(RowWalker& walker, int64_t tile_start, int64_t first, int64_t end, int64_t& last_row,
                      int64_t (&rows)[kLanes]) {
  for (int64_t t = 0; t < kLanes; ++t) {
    const int64_t position = tile_start + t;
    if (position >= first && position < end) last_row = walker.next();
    rows[t] = last_row;
  }
}

// Keys and values are requested this many tiles ahead of their use, into L2 (prefetcht1): measured on an
// AVX-512 EPYC with the cache in DRAM, a decode batch of 36 took 0.7 ms per layer with it against 1.0 ms
// without, and prefetching into L1 (prefetcht0) gained nothing.
constexpr int64_t kPrefetchTiles = 4;

// Requests the key and value rows of the walker's next `count` positions.
template <typename scalar_t>
inline void prefetch_positions(RowWalker& walker, int64_t count, const scalar_t* key_cache,
                               const scalar_t* value_cache, int64_t dim) {
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t t = 0; t < count; ++t) {
    const int64_t row = walker.next();
    const char* k = reinterpret_cast<const char*>(key_cache + row);
    const char* v = reinterpret_cast<const char*>(value_cache + row);
    for (int64_t byte = 0; byte < bytes; byte += 64) {
      __builtin_prefetch(k + byte, 0, 2);
      __builtin_prefetch(v + byte, 0, 2);
    }
  }
}

// Adds a tile's values, weighted by HEADS query heads' probabilities, to those heads' outputs, which stay in
// registers over the tile: each value vector is loaded once for all of them.
template <typename scalar_t, int CHUNKS, int HEADS>
inline void add_values(const scalar_t* values, const int64_t (&rows)[kLanes], int64_t chunks,
                       const float* probabilities, Vec* accumulator) {
  constexpr int64_t kChunks = CHUNKS ? CHUNKS : kMaxChunks;
  Vec sum[HEADS][kChunks];
  for (int64_t h = 0; h < HEADS; ++h) {
    for (int64_t c = 0; c < chunks; ++c) sum[h][c] = accumulator[h * chunks + c];
  }
  for (int64_t t = 0; t < kLanes; ++t) {
    Vec p[HEADS];
    for (int64_t h = 0; h < HEADS; ++h) p[h] = broadcast(probabilities[h * kLanes + t]);
    for (int64_t c = 0; c < chunks; ++c) {
      const Vec v = load_vector(values + rows[t] + c * kLanes);
      for (int64_t h = 0; h < HEADS; ++h) sum[h][c] += p[h] * v;
    }
  }
  for (int64_t h = 0; h < HEADS; ++h) {
    for (int64_t c = 0; c < chunks; ++c) accumulator[h * chunks + c] = sum[h][c];
  }
}

// CHUNKS is the head size in vectors when known at compile time (the common sizes), else 0.
template <typename scalar_t, int CHUNKS>
void attend_one(const DecodeShape& shape, scalar_t* out_row, const scalar_t* query_row, const scalar_t* key_cache,
                const scalar_t* value_cache, const int32_t* block_table, int64_t seq_len, int64_t kv_head,
                Vec* accumulator) {  // [group, chunks] scratch
  const int64_t chunks = CHUNKS ? CHUNKS : shape.head_dim / kLanes;
  const int64_t dim = chunks * kLanes;
  const int64_t group = shape.num_heads / shape.num_kv_heads;
  const int64_t first_head = kv_head * group;
  for (int64_t i = 0; i < group * chunks; ++i) accumulator[i] = Vec{};
  float running_max[kMaxGroup];
  float running_sum[kMaxGroup];
  std::fill(running_max, running_max + group, -std::numeric_limits<float>::infinity());
  std::fill(running_sum, running_sum + group, 0.0f);

  const int64_t first = shape.sliding_window > 0 ? std::max<int64_t>(0, seq_len - shape.sliding_window) : 0;
  RowWalker walker(shape, block_table, first, kv_head);
  int64_t last_row = RowWalker(shape, block_table, first, kv_head).next();
  int64_t tile_start = first / kLanes * kLanes;  // tiles start at multiples of kLanes, masked before `first`
  int64_t rows[kLanes];
  RowWalker prefetcher(shape, block_table, first, kv_head);
  int64_t prefetched = std::min<int64_t>(seq_len, tile_start + kPrefetchTiles * kLanes);
  prefetch_positions(prefetcher, prefetched - first, key_cache, value_cache, dim);
  IntVec lane;
  for (int64_t t = 0; t < kLanes; ++t) lane[t] = static_cast<int32_t>(t);
  for (; tile_start < seq_len; tile_start += kLanes) {
    tile_rows(walker, tile_start, first, seq_len, last_row, rows);
    const int64_t prefetch_end = std::min<int64_t>(seq_len, prefetched + kLanes);
    prefetch_positions(prefetcher, prefetch_end - prefetched, key_cache, value_cache, dim);
    prefetched = prefetch_end;
    const IntVec position = lane + static_cast<int32_t>(tile_start);
    const IntVec visible = (position >= static_cast<int32_t>(first)) & (position < static_cast<int32_t>(seq_len));
    alignas(64) float tile_probabilities[kMaxGroup * kLanes];
    for (int64_t g = 0; g < group; ++g) {
      Vec q[kMaxChunks];
      const scalar_t* query_head = query_row + (first_head + g) * dim;
      for (int64_t c = 0; c < chunks; ++c) q[c] = load_vector(query_head + c * kLanes) * shape.scale;
      Vec dots[kLanes];
      for (int64_t t = 0; t < kLanes; ++t) {
        const scalar_t* k = key_cache + rows[t];
        Vec dot = q[0] * load_vector(k);
        for (int64_t c = 1; c < chunks; ++c) dot += q[c] * load_vector(k + c * kLanes);
        dots[t] = dot;
      }
      Vec scores = sum_lanes_of_each(dots);
      scores = visible ? scores : broadcast(-std::numeric_limits<float>::infinity());
      const float tile_max = std::max(running_max[g], max_lanes(scores));
      const float rescale = std::exp(running_max[g] - tile_max);
      running_max[g] = tile_max;
      Vec probabilities = exp_nonpositive(scores - tile_max);
      probabilities = visible ? probabilities : Vec{};
      running_sum[g] = running_sum[g] * rescale + sum_lanes(probabilities);
      std::memcpy(tile_probabilities + g * kLanes, &probabilities, sizeof(probabilities));
      if (rescale != 1.0f) {
        for (int64_t c = 0; c < chunks; ++c) accumulator[g * chunks + c] *= rescale;
      }
    }
    // As many heads at a time as their outputs fit in half the vector registers.
    constexpr int kHeadsAtOnce = CHUNKS ? std::max(1, kVectorRegisters / 2 / CHUNKS) : 1;
    int64_t g = 0;
    for (; g + kHeadsAtOnce <= group; g += kHeadsAtOnce) {
      add_values<scalar_t, CHUNKS, kHeadsAtOnce>(value_cache, rows, chunks, tile_probabilities + g * kLanes,
                                                 accumulator + g * chunks);
    }
    for (; g < group; ++g) {
      add_values<scalar_t, CHUNKS, 1>(value_cache, rows, chunks, tile_probabilities + g * kLanes,
                                      accumulator + g * chunks);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inverse = 1.0f / running_sum[g];
    scalar_t* o = out_row + (first_head + g) * dim;
    for (int64_t c = 0; c < chunks; ++c) {
      const Vec result = accumulator[g * chunks + c] * inverse;
      for (int64_t i = 0; i < kLanes; ++i) o[c * kLanes + i] = static_cast<scalar_t>(result[i]);
    }
  }
}

template <typename scalar_t, int CHUNKS>
void attend_all(const DecodeShape& shape, const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                const at::Tensor& decode_rows, const at::Tensor& decode_requests) {
  scalar_t* out_data = out.data_ptr<scalar_t>();
  const scalar_t* query_data = query.const_data_ptr<scalar_t>();
  const scalar_t* key_data = key_cache.const_data_ptr<scalar_t>();
  const scalar_t* value_data = value_cache.const_data_ptr<scalar_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* rows = decode_rows.const_data_ptr<int32_t>();
  const int32_t* requests = decode_requests.const_data_ptr<int32_t>();
  const int64_t num_items = decode_rows.numel() * shape.num_kv_heads;
  const int64_t group = shape.num_heads / shape.num_kv_heads;
  std::atomic<int64_t> next_item{0};
  // One chunk per thread; the threads then take items one by one, so long contexts do not pile up on one.
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t begin, int64_t end) {
    std::vector<Vec> accumulator(group * (shape.head_dim / kLanes));
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      for (int64_t item = next_item++; item < num_items; item = next_item++) {
        const int64_t decode = item / shape.num_kv_heads;
        const int64_t request = requests[decode];
        attend_one<scalar_t, CHUNKS>(shape, out_data + rows[decode] * shape.out_row_stride,
                                     query_data + rows[decode] * shape.query_row_stride, key_data, value_data,
                                     tables + request * shape.block_table_stride, lens[request],
                                     item % shape.num_kv_heads, accumulator.data());
      }
    }
  });
}

template <typename scalar_t>
void dispatch_head_dim(const DecodeShape& shape, const at::Tensor& out, const at::Tensor& query,
                       const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, const at::Tensor& decode_rows,
                       const at::Tensor& decode_requests) {
  switch (shape.head_dim) {
    case 64:
      return attend_all<scalar_t, 64 / kLanes>(shape, out, query, key_cache, value_cache, block_tables, seq_lens,
                                     decode_rows, decode_requests);
    case 128:
      return attend_all<scalar_t, 128 / kLanes>(shape, out, query, key_cache, value_cache, block_tables, seq_lens,
                                     decode_rows, decode_requests);
    default:
      return attend_all<scalar_t, 0>(shape, out, query, key_cache, value_cache, block_tables, seq_lens,
                                     decode_rows, decode_requests);
  }
}

// out, query: [tokens, num_heads, head_dim]; key_cache, value_cache: [blocks, block_size, num_kv_heads,
// head_dim]; block_tables: int32 [requests, max_blocks]; seq_lens: int32 [requests]. Decode i takes query
// row decode_rows[i] of request decode_requests[i] (int32) and writes the same row of out.
void paged_decode_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& decode_rows,
                            const at::Tensor& decode_requests, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.device().is_cpu(), "paged_decode_attention runs on the CPU");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [tokens, heads, dim]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key and value caches must be [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == query.scalar_type(),
              "query, out and the caches must share a dtype");
  const int64_t head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "head sizes of query and cache differ");
  TORCH_CHECK(head_dim % 16 == 0 && head_dim <= kMaxHeadDim, "head size must be a multiple of 16 up to 256");
  TORCH_CHECK(query.size(1) % num_kv_heads == 0 && query.size(1) / num_kv_heads <= kMaxGroup,
              "num_heads must be a multiple of num_kv_heads, at most 64 times it");
  for (const at::Tensor* rows : {&query, &out}) {
    TORCH_CHECK(rows->stride(2) == 1 && rows->stride(1) == head_dim, "query and out rows must be contiguous");
  }
  for (const at::Tensor* cache : {&key_cache, &value_cache}) {
    TORCH_CHECK(cache->stride(3) == 1 && cache->stride(2) == head_dim && cache->stride(1) == num_kv_heads * head_dim,
                "cache blocks must be contiguous");
    TORCH_CHECK(cache->stride(0) == key_cache.stride(0), "key and value caches must share their block stride");
  }
  for (const at::Tensor* index : {&block_tables, &seq_lens, &decode_rows, &decode_requests}) {
    TORCH_CHECK(index->scalar_type() == at::kInt, "block tables, lengths and decode indices must be int32");
  }
  TORCH_CHECK(seq_lens.is_contiguous() && decode_rows.is_contiguous() && decode_requests.is_contiguous(),
              "lengths and decode indices must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1, "block_tables must be [requests, blocks]");
  TORCH_CHECK(decode_rows.numel() == decode_requests.numel(), "one request per decode row");
  const DecodeShape shape{query.size(1),    num_kv_heads,      head_dim,
                          key_cache.size(1), query.stride(0),   out.stride(0),
                          key_cache.stride(0), block_tables.stride(0), static_cast<float>(scale),
                          sliding_window};
  switch (query.scalar_type()) {
    case at::kFloat:
      return dispatch_head_dim<float>(shape, out, query, key_cache, value_cache, block_tables, seq_lens,
                                      decode_rows, decode_requests);
    case at::kBFloat16:
      return dispatch_head_dim<c10::BFloat16>(shape, out, query, key_cache, value_cache, block_tables, seq_lens,
                                              decode_rows, decode_requests);
    case at::kHalf:
      return dispatch_head_dim<c10::Half>(shape, out, query, key_cache, value_cache, block_tables, seq_lens,
                                          decode_rows, decode_requests);
    default:
      TORCH_CHECK(false, "paged_decode_attention supports float32, bfloat16 and float16, not ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(kvfleet_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor decode_rows, Tensor decode_requests, float scale, "
      "int sliding_window) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
