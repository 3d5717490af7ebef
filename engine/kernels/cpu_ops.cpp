// Fused elementwise ops of the Llama layer for CPU (and the sampler's argmax), each one pass over memory
// instead of the five to eight torch kernels (and temporaries) of the eager
// code. The arithmetic per element is the eager code's: same operations in the
// same precision and order (the build turns off fused multiply-add contraction),
// so results differ from transformers' modules only in the summation order of
// RMSNorm's mean of squares and in SiLU's exp (an approximation as accurate as
// the one torch's vectorised kernels use; libm's in double).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// Rows per parallel task: enough elements that a task outweighs its dispatch.
inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elements, 1));
}

// transformers' LlamaRMSNorm: in float32, x * rsqrt(mean(x^2) + eps), cast back
// to the input dtype, then times the weight in the input dtype.
template <typename scalar_t>
void rms_norm_impl(const at::Tensor& input, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = input.size(0), hidden = input.size(1);
  const scalar_t* x = input.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  scalar_t* y = out.data_ptr<scalar_t>();
  const int64_t in_stride = input.stride(0), out_stride = out.stride(0);
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* src = x + row * in_stride;
      scalar_t* dst = y + row * out_stride;
      float sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < hidden; ++d) {
        const float v = static_cast<float>(src[d]);
        sum += v * v;
      }
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps_f);
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d) {
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(src[d]) * inv);
        dst[d] = w[d] * normed;
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  TORCH_CHECK(input.device().is_cpu() && input.dim() == 2 && input.stride(1) == 1,
              "rms_norm: input must be a CPU [N, hidden] tensor with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == input.size(1) &&
                  weight.scalar_type() == input.scalar_type(),
              "rms_norm: weight must be [hidden], contiguous, in the input dtype");
  at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, input.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(input, weight, eps, out);
  });
  return out;
}

// transformers' apply_rotary_pos_emb (rotate-half): x * cos + rotate_half(x) * sin,
// in place on the first `num_heads` heads of x [N, >= num_heads, Dh].
template <typename scalar_t>
void rotary_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
  const int64_t rows = x.size(0), head_dim = x.size(2), half = head_dim / 2;
  scalar_t* data = x.data_ptr<scalar_t>();
  const scalar_t* cos_ptr = cos.data_ptr<scalar_t>();
  const scalar_t* sin_ptr = sin.data_ptr<scalar_t>();
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  const int64_t table_stride = cos.stride(0);
  at::parallel_for(0, rows, grain_rows(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* c = cos_ptr + row * table_stride;
      const scalar_t* s = sin_ptr + row * table_stride;
      for (int64_t head = 0; head < num_heads; ++head) {
        scalar_t* v = data + row * row_stride + head * head_stride;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const scalar_t first = v[d], second = v[d + half];
          const scalar_t a = first * c[d];
          const scalar_t b = -second * s[d];
          const scalar_t e = second * c[d + half];
          const scalar_t f = first * s[d + half];
          v[d] = a + b;
          v[d + half] = e + f;
        }
      }
    }
  });
}

void rotary_embedding_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "rotary_embedding_: x must be [N, heads, Dh]");
  TORCH_CHECK(num_heads >= 0 && num_heads <= x.size(1), "rotary_embedding_: num_heads out of range");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary_embedding_: head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  cos.sizes() == sin.sizes() && cos.stride(1) == 1 && sin.stride(1) == 1 &&
                  cos.stride(0) == sin.stride(0),
              "rotary_embedding_: cos and sin must be [N, Dh] with contiguous rows and equal strides");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_embedding_: cos, sin and x must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rotary_embedding_", [&] {
    rotary_impl<scalar_t>(x, cos, sin, num_heads);
  });
}

// silu(gate) * up for gate_up [N, 2I] (gate columns first); silu(g) = g / (1 + exp(-g)).
template <typename scalar_t>
void silu_and_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = out.size(0), width = out.size(1);
  const scalar_t* src = gate_up.data_ptr<scalar_t>();
  scalar_t* dst = out.data_ptr<scalar_t>();
  const int64_t in_stride = gate_up.stride(0);
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* gate = src + row * in_stride;
      const scalar_t* up = gate + width;
      scalar_t* y = dst + row * width;
#pragma omp simd
      for (int64_t d = 0; d < width; ++d) {
        if constexpr (std::is_same_v<scalar_t, double>) {
          y[d] = gate[d] / (1.0 + baton::exp_approx(-gate[d])) * up[d];
        } else {
          const float g = static_cast<float>(gate[d]);
          const scalar_t activated = static_cast<scalar_t>(g / (1.0f + baton::exp_approx(-g)));
          y[d] = activated * up[d];
        }
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be a CPU [N, 2I] tensor with contiguous rows");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(gate_up, out);
  });
  return out;
}

template <typename scalar_t>
int64_t argmax_scalar(const scalar_t* x, int64_t width) {
  int64_t best_index = 0;
  scalar_t best = x[0];
  if (std::isnan(static_cast<double>(best))) {
    return 0;
  }
  for (int64_t i = 1; i < width; ++i) {
    const scalar_t v = x[i];
    if (v > best) {
      best = v;
      best_index = i;
    } else if (std::isnan(static_cast<double>(v))) {
      return i;
    }
  }
  return best_index;
}

template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t width) {
  return argmax_scalar(x, width);
}

#ifdef __AVX512F__
// float: sixteen running maxima and their first indices, then the smallest
// index among the lanes holding the overall maximum. A row with a NaN goes
// through the scalar loop, which finds the first one.
template <>
int64_t argmax_row<float>(const float* x, int64_t width) {
  if (width < 16 || width > (int64_t{1} << 30)) {
    return argmax_scalar(x, width);
  }
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_index = _mm512_setzero_si512();
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 has_nan = 0;
  int64_t i = 0;
  for (; i + 16 <= width; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    has_nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_mask_mov_ps(best, greater, v);
    best_index = _mm512_mask_mov_epi32(best_index, greater, index);
    index = _mm512_add_epi32(index, step);
  }
  if (has_nan) {
    return argmax_scalar(x, width);
  }
  alignas(64) float lane_best[16];
  alignas(64) int32_t lane_index[16];
  _mm512_store_ps(lane_best, best);
  _mm512_store_si512(lane_index, best_index);
  float top = lane_best[0];
  int64_t top_index = lane_index[0];
  for (int lane = 1; lane < 16; ++lane) {
    if (lane_best[lane] > top || (lane_best[lane] == top && lane_index[lane] < top_index)) {
      top = lane_best[lane];
      top_index = lane_index[lane];
    }
  }
  for (; i < width; ++i) {  // the tail's indices all come after the vector part's
    if (x[i] > top) {
      top = x[i];
      top_index = i;
    } else if (std::isnan(x[i])) {
      return i;
    }
  }
  return top_index;
}
#endif

// Index of each row's largest value, the first one on ties and the first NaN
// if there is one (torch.argmax's rules). torch's own reduction is slow for a
// few rows of a vocabulary-sized width, the shape of greedy sampling.
template <typename scalar_t>
void argmax_rows_impl(const at::Tensor& input, at::Tensor& out) {
  const int64_t rows = input.size(0), width = input.size(1);
  const scalar_t* data = input.data_ptr<scalar_t>();
  const int64_t stride = input.stride(0);
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      result[row] = argmax_row(data + row * stride, width);
    }
  });
}

at::Tensor argmax_rows(const at::Tensor& input) {
  TORCH_CHECK(input.device().is_cpu() && input.dim() == 2 && input.stride(1) == 1 && input.size(1) > 0,
              "argmax_rows: input must be a CPU [N, V] tensor, V > 0, with contiguous rows");
  at::Tensor out = at::empty({input.size(0)}, input.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, input.scalar_type(), "argmax_rows", [&] {
    argmax_rows_impl<scalar_t>(input, out);
  });
  return out;
}

// A mixture of experts' matmuls at decode: rows [S, K] grouped by expert (expert e's
// rows are [offsets[e], offsets[e + 1])), times each group's expert weight [E, N, K]
// transposed: out [S, N]. At decode an expert gets a handful of rows, too few for a
// GEMM library to pay for packing its weight at every call; here each weight row is
// read once from memory and kept in L1 while every row of its expert uses it: tiles of
// 4 rows by 4 weight rows, 16 accumulators of 16 floats, explicit FMAs over K.
constexpr int64_t kTile = 4;
constexpr int64_t kTaskRows = 64;  // weight rows a parallel task streams (64 x K floats)

#ifdef __AVX512F__
inline void expert_tile(const float* x, int64_t mb, const float* w, int64_t nb, int64_t K, float* out,
                        int64_t out_stride) {
  const float* xs[kTile];
  const float* ws[kTile];
  for (int64_t i = 0; i < kTile; ++i) {
    xs[i] = x + std::min(i, mb - 1) * K;  // a tail repeats its last row, stored nowhere
    ws[i] = w + std::min(i, nb - 1) * K;
  }
  __m512 acc[kTile][kTile];
  for (int64_t i = 0; i < kTile; ++i) {
    for (int64_t j = 0; j < kTile; ++j) {
      acc[i][j] = _mm512_setzero_ps();
    }
  }
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[kTile];
    for (int64_t j = 0; j < kTile; ++j) {
      wv[j] = _mm512_loadu_ps(ws[j] + k);
      // The weight rows four tiles ahead, into L2 (one tile ahead into L1: about 5% slower).
      _mm_prefetch(reinterpret_cast<const char*>(ws[j] + 4 * kTile * K + k), _MM_HINT_T1);
    }
    for (int64_t i = 0; i < kTile; ++i) {
      const __m512 xv = _mm512_loadu_ps(xs[i] + k);
      for (int64_t j = 0; j < kTile; ++j) {
        acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[kTile];
    for (int64_t j = 0; j < kTile; ++j) {
      wv[j] = _mm512_maskz_loadu_ps(mask, ws[j] + k);
    }
    for (int64_t i = 0; i < kTile; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, xs[i] + k);
      for (int64_t j = 0; j < kTile; ++j) {
        acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
  }
  for (int64_t i = 0; i < mb; ++i) {
    for (int64_t j = 0; j < nb; ++j) {
      out[i * out_stride + j] = _mm512_reduce_add_ps(acc[i][j]);
    }
  }
}
#else
inline void expert_tile(const float* x, int64_t mb, const float* w, int64_t nb, int64_t K, float* out,
                        int64_t out_stride) {
  for (int64_t i = 0; i < mb; ++i) {
    for (int64_t j = 0; j < nb; ++j) {
      float sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        sum = std::fma(x[i * K + k], w[j * K + k], sum);
      }
      out[i * out_stride + j] = sum;
    }
  }
}
#endif

at::Tensor grouped_matmul(const at::Tensor& rows, const at::Tensor& weight, const at::Tensor& offsets) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.dim() == 2 && rows.is_contiguous(),
              "grouped_matmul: rows must be a contiguous float32 CPU [S, K] tensor");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 3 && weight.is_contiguous() &&
                  weight.size(2) == rows.size(1),
              "grouped_matmul: weight must be a contiguous float32 [E, N, K] tensor, K as the rows'");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.size(0) == weight.size(0) + 1,
              "grouped_matmul: offsets must be int64 [E + 1]");
  const int64_t S = rows.size(0), K = rows.size(1), E = weight.size(0), N = weight.size(1);
  at::Tensor out = at::empty({S, N}, rows.options());
  const int64_t* off = offsets.contiguous().data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == S, "grouped_matmul: offsets must run from 0 to the number of rows");
  // One task per (expert with rows, kTaskRows of its weight rows).
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(off[e + 1] >= off[e], "grouped_matmul: offsets must not decrease");
    if (off[e + 1] > off[e]) {
      for (int64_t n = 0; n < N; n += kTaskRows) {
        tasks.emplace_back(e, n);
      }
    }
  }
  const float* x = rows.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [e, n_begin] = tasks[t];
      const int64_t n_end = std::min(N, n_begin + kTaskRows);
      for (int64_t n = n_begin; n < n_end; n += kTile) {
        const int64_t nb = std::min(kTile, n_end - n);
        for (int64_t m = off[e]; m < off[e + 1]; m += kTile) {
          expert_tile(x + m * K, std::min(kTile, off[e + 1] - m), w + (e * N + n) * K, nb, K, y + m * N + n, N);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("rotary_embedding_(Tensor(a!) x, Tensor cos, Tensor sin, int num_heads) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor input) -> Tensor");
  m.def("grouped_matmul(Tensor rows, Tensor weight, Tensor offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_embedding_", &rotary_embedding_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("grouped_matmul", &grouped_matmul);
}
