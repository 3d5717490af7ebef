// Scalar math the CPU kernels share, written so that loops calling it vectorize.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace baton {

// exp(x) in float: x = n ln2 + r with |r| <= ln2/2, then 2^n times a degree-6
// polynomial for exp(r) (relative error ~2e-7, about one ulp, like the
// vectorised exp torch's CPU kernels use). x is clamped to [-87, 88], where
// float stays normal: exp(-87) ~ 1.6e-38, exp(88) ~ 1.7e38.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = std::fma(n, -0.693145751953125f, std::fma(n, -1.428606765330187045e-06f, x));
  float p = 1.0f / 720.0f;
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

// Double stays exact: float64 runs exist for parity checks, not speed.
inline double exp_approx(double x) {
  return std::exp(x);
}

// silu(g) = g / (1 + exp(-g)), as torch's SiLU rounds it (float or double).
template <typename T>
inline T silu(T g) {
  return g / (T(1) + exp_approx(-g));
}

}  // namespace baton
