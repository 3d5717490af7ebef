// Paged decode attention for CPU: one query token per sequence attending to the
// keys and values in that sequence's KV blocks, read straight from the paged
// cache (no gather into a padded copy).
//
// Cache layout, per layer: [num_blocks, block_size, num_kv_heads, head_dim],
// contiguous. Block table row s lists sequence s's blocks in order; slot t of a
// sequence is block_tables[s][t / block_size], offset t % block_size.
//
// Work item = (sequence, kv head). Each item holds the G = H / KvH query heads
// of its KV head, reads each of its keys once (G dot products per key) and each
// of its values once (G weighted sums per value): an exact two-pass softmax over
// a score row kept in a per-thread buffer. Threads take items from a shared
// counter, longest sequences first, so uneven lengths balance across threads.
// Accumulation is in float for float/bfloat16 and in double for double.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <limits>
#include <numeric>
#include <vector>

namespace {

template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};

// sum_d a[d] * b[d]; the simd reduction lets the compiler split the sum into
// vector lanes (a different summation order from a serial loop, as in any BLAS).
template <typename acc_t, typename scalar_t>
inline acc_t dot(const acc_t* __restrict a, const scalar_t* __restrict b, int64_t n) {
  acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) {
    sum += a[d] * static_cast<acc_t>(b[d]);
  }
  return sum;
}

#ifdef __AVX512F__
// The float case, by hand: the compiler's simd reduction ends in sixteen scalar
// adds, which cost more than the multiplies for head sizes like 64.
template <>
inline float dot<float, float>(const float* __restrict a, const float* __restrict b, int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), sum);
  }
  float tail = 0;
  for (; d < n; ++d) {
    tail += a[d] * b[d];
  }
  return _mm512_reduce_add_ps(sum) + tail;
}
#endif

// acc[d] += w * v[d]
template <typename acc_t, typename scalar_t>
inline void axpy(acc_t* __restrict acc, acc_t w, const scalar_t* __restrict v, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) {
    acc[d] += w * static_cast<acc_t>(v[d]);
  }
}

// acc[d] += sum_t weights[t] * values[t * stride + d], t < num_tokens.
template <typename acc_t, typename scalar_t>
inline void accumulate_values(
    acc_t* __restrict acc,
    const acc_t* __restrict weights,
    const scalar_t* __restrict values,
    int64_t num_tokens,
    int64_t stride,
    int64_t head_dim) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    axpy(acc, weights[t], values + t * stride, head_dim);
  }
}

#ifdef __AVX512F__
// The float case keeps 64 accumulator lanes in registers across the tokens.
template <>
inline void accumulate_values<float, float>(
    float* __restrict acc,
    const float* __restrict weights,
    const float* __restrict values,
    int64_t num_tokens,
    int64_t stride,
    int64_t head_dim) {
  int64_t d = 0;
  for (; d + 64 <= head_dim; d += 64) {
    __m512 a0 = _mm512_loadu_ps(acc + d), a1 = _mm512_loadu_ps(acc + d + 16);
    __m512 a2 = _mm512_loadu_ps(acc + d + 32), a3 = _mm512_loadu_ps(acc + d + 48);
    for (int64_t t = 0; t < num_tokens; ++t) {
      const float* v = values + t * stride + d;
      const __m512 w = _mm512_set1_ps(weights[t]);
      a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v), a0);
      a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16), a1);
      a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 32), a2);
      a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 48), a3);
    }
    _mm512_storeu_ps(acc + d, a0);
    _mm512_storeu_ps(acc + d + 16, a1);
    _mm512_storeu_ps(acc + d + 32, a2);
    _mm512_storeu_ps(acc + d + 48, a3);
  }
  for (; d < head_dim; ++d) {
    float sum = acc[d];
    for (int64_t t = 0; t < num_tokens; ++t) {
      sum += weights[t] * values[t * stride + d];
    }
    acc[d] = sum;
  }
}
#endif

// scores[i] = q . keys[i * stride : i * stride + head_dim] for i < num_tokens.
template <typename acc_t, typename scalar_t>
inline void key_scores(
    const acc_t* __restrict q,
    const scalar_t* __restrict keys,
    int64_t stride,
    int64_t num_tokens,
    int64_t head_dim,
    acc_t* __restrict scores) {
  for (int64_t i = 0; i < num_tokens; ++i) {
    scores[i] = dot(q, keys + i * stride, head_dim);
  }
}

#ifdef __AVX512F__
// Sixteen vectors in, one out: lane i holds the sum of v[i]'s lanes. A tree of
// 15 adds and 30 shuffles, where 16 separate horizontal sums cost ~4x as many.
inline __m512 transpose_sum16(const __m512* v) {
  __m512 pairs[8];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  }
  __m512 quads[4];
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: the lane sums of v[4k..4k+3]
    const __m512d c = _mm512_castps_pd(pairs[2 * k]), d = _mm512_castps_pd(pairs[2 * k + 1]);
    quads[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  // Add the four 128-bit lanes of each quad together.
  const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(q01, q23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// float, head_dim a multiple of 16: sixteen keys at a time, summed by one transpose.
template <>
inline void key_scores<float, float>(
    const float* __restrict q,
    const float* __restrict keys,
    int64_t stride,
    int64_t num_tokens,
    int64_t head_dim,
    float* __restrict scores) {
  if (head_dim % 16 != 0) {
    for (int64_t i = 0; i < num_tokens; ++i) {
      scores[i] = dot(q, keys + i * stride, head_dim);
    }
    return;
  }
  for (int64_t start = 0; start < num_tokens; start += 16) {
    const int64_t count = std::min<int64_t>(16, num_tokens - start);
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) {
      acc[i] = _mm512_setzero_ps();
    }
    for (int64_t d = 0; d < head_dim; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      for (int64_t i = 0; i < count; ++i) {
        acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys + (start + i) * stride + d), acc[i]);
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1u);
    _mm512_mask_storeu_ps(scores + start, valid, transpose_sum16(acc));
  }
}
#endif

// Ask for the cache lines of `num_tokens` rows of `row_bytes` bytes, `stride`
// elements apart, ahead of their use (into L2: a core has few L1 fill buffers,
// and with the KV out of cache the kernel is bound by misses in flight).
template <typename scalar_t>
inline void prefetch_block(const scalar_t* base, int64_t num_tokens, int64_t stride, int64_t row_bytes) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const char* row = reinterpret_cast<const char*>(base + t * stride);
    for (int64_t offset = 0; offset < row_bytes; offset += 64) {
      __builtin_prefetch(row + offset, 0, 1);
    }
  }
}

template <typename scalar_t>
void decode_attention_impl(
    const at::Tensor& query,  // [D, H, Dh], last dim contiguous
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& block_tables,  // [D, max_blocks] int64
    const at::Tensor& seq_lens,  // [D] int64
    double scale,
    at::Tensor& out) {  // [D, H, Dh], last dim contiguous
  using acc_t = typename AccType<scalar_t>::type;
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between slots in the cache
  const int64_t block_stride = key_cache.stride(0);  // any: a block-major cache strides by all layers

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t out_seq_stride = out.stride(0), out_head_stride = out.stride(1);
  const scalar_t* k_ptr = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();

  // Longest sequences first, so the last items taken are the short ones.
  std::vector<int64_t> order(num_seqs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  // An item is one sequence and a run of its KV heads: all of them (so each
  // position's keys are one contiguous read) unless there are too few
  // sequences to keep every thread busy, then one KV head per item.
  const int64_t num_threads = at::get_num_threads();
  const int64_t heads_per_item = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  const int64_t num_items = num_seqs * items_per_seq;
  const int64_t q_rows = heads_per_item * group;  // query heads per item
  std::atomic<int64_t> next_item{0};

  auto run_item = [&](int64_t item, std::vector<acc_t>& scores, std::vector<acc_t>& work) {
    const int64_t seq = order[item / items_per_seq];
    const int64_t first_kv_head = (item % items_per_seq) * heads_per_item;
    const int64_t seq_len = lens[seq];
    const int64_t* table = tables + seq * table_stride;
    scores.resize(q_rows * seq_len);
    work.resize(2 * q_rows * head_dim + q_rows);
    acc_t* q = work.data();  // [rows, Dh] scaled queries
    acc_t* acc = q + q_rows * head_dim;  // [rows, Dh] weighted value sums
    acc_t* row_sum = acc + q_rows * head_dim;  // [rows]
    const int64_t first_head = first_kv_head * group;
    for (int64_t r = 0; r < q_rows; ++r) {
      const scalar_t* src = q_ptr + seq * q_seq_stride + (first_head + r) * q_head_stride;
      for (int64_t d = 0; d < head_dim; ++d) {
        q[r * head_dim + d] = static_cast<acc_t>(src[d]) * static_cast<acc_t>(scale);
      }
      row_sum[r] = 0;
    }
    const int64_t head_offset = first_kv_head * head_dim;

    // Pass 1: scores, one read of each position's keys. Blocks are scattered
    // in memory, so the next block is prefetched while this one is used.
    const int64_t item_bytes = heads_per_item * head_dim * static_cast<int64_t>(sizeof(scalar_t));
    for (int64_t block_start = 0; block_start < seq_len; block_start += block_size) {
      const int64_t block_index = block_start / block_size;
      const int64_t block_len = std::min(block_size, seq_len - block_start);
      if (block_start + block_size < seq_len) {
        prefetch_block(k_ptr + table[block_index + 1] * block_stride + head_offset,
                       std::min(block_size, seq_len - block_start - block_size), token_stride, item_bytes);
      }
      const scalar_t* block_keys = k_ptr + table[block_index] * block_stride + head_offset;
      for (int64_t r = 0; r < q_rows; ++r) {
        key_scores(q + r * head_dim, block_keys + (r / group) * head_dim, token_stride, block_len, head_dim,
                   scores.data() + r * seq_len + block_start);
      }
    }
    // Softmax numerators and denominators.
    for (int64_t r = 0; r < q_rows; ++r) {
      acc_t* row = scores.data() + r * seq_len;
      acc_t m = -std::numeric_limits<acc_t>::infinity();
#pragma omp simd reduction(max : m)
      for (int64_t t = 0; t < seq_len; ++t) {
        m = std::max(m, row[t]);
      }
      acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < seq_len; ++t) {
        row[t] = baton::exp_approx(row[t] - m);
        sum += row[t];
      }
      row_sum[r] = sum;
    }
    // Pass 2: weighted values, one read of each position's values (block by
    // block, so a block's values stay in L1 while every query row uses them).
    std::fill(acc, acc + q_rows * head_dim, acc_t(0));
    for (int64_t block_start = 0; block_start < seq_len; block_start += block_size) {
      const int64_t block_len = std::min(block_size, seq_len - block_start);
      if (block_start + block_size < seq_len) {
        prefetch_block(v_ptr + table[block_start / block_size + 1] * block_stride + head_offset,
                       std::min(block_size, seq_len - block_start - block_size), token_stride, item_bytes);
      }
      const scalar_t* block_values =
          v_ptr + table[block_start / block_size] * block_stride + head_offset;
      for (int64_t r = 0; r < q_rows; ++r) {
        accumulate_values(
            acc + r * head_dim,
            scores.data() + r * seq_len + block_start,
            block_values + (r / group) * head_dim,
            block_len,
            token_stride,
            head_dim);
      }
    }
    for (int64_t r = 0; r < q_rows; ++r) {
      scalar_t* dst = out_ptr + seq * out_seq_stride + (first_head + r) * out_head_stride;
      const acc_t inv = acc_t(1) / row_sum[r];
      for (int64_t d = 0; d < head_dim; ++d) {
        dst[d] = static_cast<scalar_t>(acc[r * head_dim + d] * inv);
      }
    }
  };

  const int64_t num_workers = std::min<int64_t>(num_threads, num_items);
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scores, work;
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t item = next_item.fetch_add(1); item < num_items; item = next_item.fetch_add(1)) {
        run_item(item, scores, work);
      }
    }
  });
}

void paged_decode_attention(
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& block_tables,
    const at::Tensor& seq_lens,
    double scale,
    at::Tensor out) {
  TORCH_CHECK(query.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "query and out must be [D, H, Dh]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.stride(3) == 1 && key_cache.stride(2) == key_cache.size(3) &&
                  key_cache.stride(1) == key_cache.size(2) * key_cache.size(3) &&
                  key_cache.stride(0) >= key_cache.size(1) * key_cache.stride(1),
              "caches must be [num_blocks, block_size, KvH, Dh], contiguous within a block, blocks disjoint");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.strides() == value_cache.strides(),
              "key and value caches differ in shape or strides");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(query.sizes() == out.sizes(), "query and out differ in shape");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "head_dim differs between query and cache");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, caches and out must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && block_tables.size(0) == query.size(0),
              "block_tables must be [D, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous() && seq_lens.size(0) == query.size(0),
              "seq_lens must be [D]");
  if (query.size(0) == 0) {
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(query, key_cache, value_cache, block_tables, seq_lens, scale, out);
  });
}

}  // namespace

TORCH_LIBRARY(baton, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
