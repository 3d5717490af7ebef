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
          y[d] = baton::silu(gate[d]) * up[d];
        } else {
          y[d] = static_cast<scalar_t>(baton::silu(static_cast<float>(gate[d]))) * up[d];
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

// A mixture of experts' SwiGLU experts on CPU, float32, in one call:
//   out[t] = sum over t's slots j, in ascending expert order, of
//            weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = expert_ids[t, j]
// (transformers' loop over experts, index_add_ into a zeroed output, op for op up
// to the matmuls' summation order).
//
// The weights are packed once at load (engine/kernels/__init__.py's
// pack_moe_weights) into panels of 32 output columns, each panel [K, 32]
// contiguous: one sequential stream per panel, read once per 8 rows of its
// expert. A gate/up panel holds 16 gate columns and the same 16 up columns, so its
// tile ends as 16 finished activations. The micro-kernel is the usual outer product:
// per k, two vectors of the panel times each row's broadcast x[k], 8 rows by 32
// columns of accumulators, no horizontal sums.
//   gate_up [E, ceil(I / 16), H, 32]   down [E, ceil(H / 32), I, 32]
// Zero-padded columns past I or H are computed and never stored.
//
// Two passes, each parallel over tasks that write disjoint memory:
//   1. (expert, gate/up panel) pairs: the expert's slots read their tokens' rows of
//      x in place (no gathered copy) and write 16 columns of act [slots, I];
//   2. down panels: every expert in ascending order, each slot's output times its
//      routing weight added into its token's 32 columns of out, so a token's sum
//      runs in expert order without atomics.
constexpr int64_t kPanel = 32;    // output columns of a packed panel
constexpr int64_t kHalfPanel = kPanel / 2;  // a gate/up panel's gate (or up) columns
constexpr int64_t kTileRows = 8;  // rows of a micro-kernel tile

// acc[i][c] = sum_k rows[i][k] * panel[k][c] for MB rows and the panel's 32 columns.
#ifdef __AVX512F__
template <int MB>
inline void panel_tile(const float* const* rows, const float* panel, int64_t K, float (*acc)[kPanel]) {
  __m512 lo[MB], hi[MB];
  for (int i = 0; i < MB; ++i) {
    lo[i] = _mm512_setzero_ps();
    hi[i] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w_lo = _mm512_loadu_ps(panel + k * kPanel);
    const __m512 w_hi = _mm512_loadu_ps(panel + k * kPanel + 16);
    for (int i = 0; i < MB; ++i) {
      const __m512 x = _mm512_set1_ps(rows[i][k]);
      lo[i] = _mm512_fmadd_ps(x, w_lo, lo[i]);
      hi[i] = _mm512_fmadd_ps(x, w_hi, hi[i]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    _mm512_storeu_ps(acc[i], lo[i]);
    _mm512_storeu_ps(acc[i] + 16, hi[i]);
  }
}
#else
template <int MB>
inline void panel_tile(const float* const* rows, const float* panel, int64_t K, float (*acc)[kPanel]) {
  for (int i = 0; i < MB; ++i) {
    for (int64_t c = 0; c < kPanel; ++c) {
      acc[i][c] = 0;
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    for (int i = 0; i < MB; ++i) {
      const float x = rows[i][k];
#pragma omp simd
      for (int64_t c = 0; c < kPanel; ++c) {
        acc[i][c] = std::fma(x, w[c], acc[i][c]);
      }
    }
  }
}
#endif

using PanelTile = void (*)(const float* const*, const float*, int64_t, float (*)[kPanel]);
constexpr PanelTile kPanelTiles[kTileRows] = {panel_tile<1>, panel_tile<2>, panel_tile<3>, panel_tile<4>,
                                              panel_tile<5>, panel_tile<6>, panel_tile<7>, panel_tile<8>};

at::Tensor moe_experts(const at::Tensor& hidden, const at::Tensor& expert_ids, const at::Tensor& weights,
                       const at::Tensor& gate_up, const at::Tensor& down, int64_t intermediate) {
  TORCH_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == at::kFloat && hidden.dim() == 2 &&
                  hidden.is_contiguous(),
              "moe_experts: hidden must be a contiguous float32 CPU [N, H] tensor");
  const int64_t N = hidden.size(0), H = hidden.size(1), I = intermediate;
  TORCH_CHECK(expert_ids.scalar_type() == at::kLong && expert_ids.dim() == 2 && expert_ids.size(0) == N &&
                  expert_ids.is_contiguous(),
              "moe_experts: expert_ids must be a contiguous int64 [N, k] tensor");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == expert_ids.sizes() && weights.is_contiguous(),
              "moe_experts: weights must be a contiguous float32 tensor shaped like expert_ids");
  const int64_t E = gate_up.size(0), gate_panels = (I + kHalfPanel - 1) / kHalfPanel, down_panels = (H + kPanel - 1) / kPanel;
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() &&
                  gate_up.sizes() == at::IntArrayRef({E, gate_panels, H, kPanel}),
              "moe_experts: gate_up must be packed by pack_moe_weights: [E, ceil(I / 16), H, 32] float32");
  TORCH_CHECK(down.scalar_type() == at::kFloat && down.is_contiguous() &&
                  down.sizes() == at::IntArrayRef({E, down_panels, I, kPanel}),
              "moe_experts: down must be packed by pack_moe_weights: [E, ceil(H / 32), I, 32] float32");
  const int64_t top_k = expert_ids.size(1), S = N * top_k;
  const int64_t* ids = expert_ids.data_ptr<int64_t>();

  // The slots grouped by expert, each group in slot order (a counting sort).
  std::vector<int64_t> offsets(E + 1, 0), order(S);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < E, "moe_experts: expert id ", ids[s], " is not in [0, ", E, ")");
    ++offsets[ids[s] + 1];
  }
  for (int64_t e = 0; e < E; ++e) {
    offsets[e + 1] += offsets[e];
  }
  {
    std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
    for (int64_t s = 0; s < S; ++s) {
      order[next[ids[s]]++] = s;
    }
  }
  const float* x = hidden.data_ptr<float>();
  const float* route = weights.data_ptr<float>();
  const float* w13 = gate_up.data_ptr<float>();
  const float* w2 = down.data_ptr<float>();
  at::Tensor act = at::empty({S, I}, hidden.options());
  float* a = act.data_ptr<float>();
  at::Tensor out = at::zeros({N, H}, hidden.options());
  float* y = out.data_ptr<float>();

  // 1. gate/up and the activation: act[j] = silu(gate_e(x_t)) * up_e(x_t) for the j-th
  // slot in expert order.
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t e = 0; e < E; ++e) {
    if (offsets[e + 1] > offsets[e]) {
      for (int64_t p = 0; p < gate_panels; ++p) {
        tasks.emplace_back(e, p);
      }
    }
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    const float* rows[kTileRows];
    float acc[kTileRows][kPanel];
    for (int64_t t = begin; t < end; ++t) {
      const auto [e, p] = tasks[t];
      const float* panel = w13 + (e * gate_panels + p) * H * kPanel;
      const int64_t c0 = p * kHalfPanel, width = std::min(kHalfPanel, I - c0);
      for (int64_t j = offsets[e]; j < offsets[e + 1]; j += kTileRows) {
        const int64_t mb = std::min(kTileRows, offsets[e + 1] - j);
        for (int64_t i = 0; i < mb; ++i) {
          rows[i] = x + (order[j + i] / top_k) * H;
        }
        kPanelTiles[mb - 1](rows, panel, H, acc);
        for (int64_t i = 0; i < mb; ++i) {
          float* dst = a + (j + i) * I + c0;
          const float* g = acc[i];
          const float* u = acc[i] + kHalfPanel;
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) {
            dst[c] = baton::silu(g[c]) * u[c];
          }
        }
      }
    }
  });

  // 2. down, times the routing weight, into each slot's token's row, experts ascending.
  at::parallel_for(0, down_panels, 1, [&](int64_t begin, int64_t end) {
    const float* rows[kTileRows];
    float acc[kTileRows][kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t c0 = p * kPanel, width = std::min(kPanel, H - c0);
      for (int64_t e = 0; e < E; ++e) {
        const float* panel = w2 + (e * down_panels + p) * I * kPanel;
        for (int64_t j = offsets[e]; j < offsets[e + 1]; j += kTileRows) {
          const int64_t mb = std::min(kTileRows, offsets[e + 1] - j);
          for (int64_t i = 0; i < mb; ++i) {
            rows[i] = a + (j + i) * I;
          }
          kPanelTiles[mb - 1](rows, panel, I, acc);
          for (int64_t i = 0; i < mb; ++i) {
            const int64_t slot = order[j + i];
            const float r = route[slot];
            float* dst = y + (slot / top_k) * H + c0;
            const float* v = acc[i];
#pragma omp simd
            for (int64_t c = 0; c < width; ++c) {
              dst[c] = dst[c] + v[c] * r;
            }
          }
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
  m.def("moe_experts(Tensor hidden, Tensor expert_ids, Tensor weights, Tensor gate_up, Tensor down, int intermediate) -> Tensor");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_embedding_", &rotary_embedding_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("moe_experts", &moe_experts);
}
