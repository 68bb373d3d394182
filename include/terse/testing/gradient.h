// Synthetic gradients: normal values with sparse large outliers. One generator for the codec
// tests, the benchmarks and calibration, so that every figure they report is measured on the
// same family of inputs. Needs only the C++ standard library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace terse::testing {

// Normal values of scale `sigma`, and every `outlier_every`-th element from `first_outlier` on
// kOutlierScale times larger (outlier_every 0: none): a few coordinates of a gradient are far
// larger than the rest, which is what scaling and sparsifying codecs must survive.
struct GradientShape {
  float sigma = 1e-2f;
  std::size_t outlier_every = 97;
  std::size_t first_outlier = 0;
};
inline constexpr float kOutlierScale = 50.0f;

// The benchmarks' and calibration's input: scale 1e-3, one outlier in 9973 elements.
inline constexpr GradientShape kBenchmarkGradient{1e-3f, 9973, 0};
// The same scale without outliers (the collectives' and PowerSGD's benchmarks).
inline constexpr GradientShape kNormalGradient{1e-3f, 0, 0};

// Fills x with a synthetic gradient of `shape`, drawn from std::mt19937_64 seeded with `seed`.
inline void fill_gradient(std::span<float> x, std::uint64_t seed,
                          const GradientShape& shape = {}) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal(0.0f, shape.sigma);
  for (auto& v : x) v = normal(gen);
  if (shape.outlier_every == 0) return;
  for (std::size_t i = shape.first_outlier; i < x.size(); i += shape.outlier_every) {
    x[i] *= kOutlierScale;
  }
}

inline std::vector<float> synthetic_gradient(std::size_t n, std::uint64_t seed,
                                             const GradientShape& shape = {}) {
  std::vector<float> x(n);
  fill_gradient(x, seed, shape);
  return x;
}

}  // namespace terse::testing
