// Statistical tests of the counter-based generator: agreement of the vector kernel with the
// scalar reference, moments, bucket uniformity, and independence across keys and indices.
#include "kit/random.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "terse/codec.h"

namespace terse::kit {
namespace {

constexpr std::size_t kN = 1 << 20;

std::vector<float> draw(std::uint64_t key, std::uint64_t first = 0, std::size_t n = kN) {
  std::vector<float> u(n);
  uniform(key, first, u);
  return u;
}

TEST(Random, StreamIsPinned) {
  // Changing these changes every stochastic codec's output: bump the wire version if so.
  EXPECT_EQ(random_bits(0, 0), hash32_round(hash32_round(0)));
  EXPECT_EQ(random_bits(0x0123456789abcdefull, 5),
            hash32_round(hash32_round(5u ^ 0x89abcdefu) + 0x01234567u));
  EXPECT_EQ(hash32_round(1), 0x86d2fa73u) << std::hex << hash32_round(1);
}

TEST(Random, VectorMatchesScalarEverywhere) {
  const std::uint64_t key = 0x9e3779b97f4a7c15ull;
  for (std::uint64_t first : {0ull, 1ull, 12345ull, 0xffffffffull - 20, 0x1fffffff0ull,
                              0xfffffffffffffff0ull}) {
    for (std::size_t n : {0, 1, 3, 15, 16, 17, 40, 1001}) {
      auto u = draw(key, first, n);
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(u[i], uniform_at(key, first + i)) << "first=" << first << " i=" << i;
      }
    }
  }
}

TEST(Random, SegmentsAbove4GAreDifferentStreams) {
  const std::uint64_t key = 77;
  auto a = draw(key, 0, 1000), b = draw(key, std::uint64_t{1} << 32, 1000);
  int equal = 0;
  for (std::size_t i = 0; i < a.size(); ++i) equal += a[i] == b[i];
  EXPECT_LT(equal, 5);
}

TEST(Random, RangeAndResolution) {
  auto u = draw(3);
  for (float v : u) {
    ASSERT_GE(v, 0.0f);
    ASSERT_LT(v, 1.0f);
    float scaled = v * 16777216.0f;
    ASSERT_EQ(scaled, std::floor(scaled));  // a multiple of 2^-24
  }
}

TEST(Random, MeanAndVariance) {
  for (std::uint64_t key : {0ull, 1ull, 0xdeadbeefull, ~0ull}) {
    auto u = draw(key);
    double s = 0, q = 0;
    for (float v : u) s += v;
    double mean = s / kN;
    for (float v : u) q += (v - 0.5) * (v - 0.5);
    double var = q / kN;
    // Standard errors of the estimators for U[0,1): sqrt(1/12/n) and sqrt((1/80-1/144)/n).
    EXPECT_NEAR(mean, 0.5, 5 * std::sqrt(1.0 / 12 / kN)) << key;
    EXPECT_NEAR(var, 1.0 / 12, 5 * std::sqrt((1.0 / 80 - 1.0 / 144) / kN)) << key;
  }
}

// Chi-square of 256 equiprobable buckets: mean 255, standard deviation sqrt(510) ~ 22.6.
double chi_square(const std::vector<int>& counts, double expected) {
  double c = 0;
  for (int k : counts) c += (k - expected) * (k - expected) / expected;
  return c;
}

// Chi-square of the 16 x 16 grid of disjoint consecutive pairs (u_i, u_{i+1}): catches serial
// correlation.
double pairs_chi_square(const std::vector<float>& u) {
  std::vector<int> grid(256);
  for (std::size_t i = 0; i + 1 < u.size(); i += 2) {
    ++grid[static_cast<int>(u[i] * 16) * 16 + static_cast<int>(u[i + 1] * 16)];
  }
  return chi_square(grid, static_cast<double>(u.size() / 2) / 256.0);
}

// Chi-square of 256 equal buckets of [0, 1).
double buckets_chi_square(const std::vector<float>& u) {
  std::vector<int> counts(256);
  for (float v : u) ++counts[static_cast<int>(v * 256)];
  return chi_square(counts, static_cast<double>(u.size()) / 256.0);
}

constexpr double kChiSquareLimit = 255 + 6 * 22.6;

TEST(Random, ChiSquareOnBuckets) {
  for (std::uint64_t key : {5ull, 0x123456789ull}) {
    auto u = draw(key);
    std::vector<int> low(256);
    for (std::size_t i = 0; i < kN; ++i) ++low[random_bits(key, i) & 255];  // dropped by uniform()
    EXPECT_LT(buckets_chi_square(u), kChiSquareLimit) << key;
    EXPECT_GT(buckets_chi_square(u), 255 - 6 * 22.6) << key;
    EXPECT_LT(chi_square(low, kN / 256.0), kChiSquareLimit) << key;
  }
}


TEST(Random, PairsOfConsecutiveValuesAreUniform) {
  EXPECT_LT(pairs_chi_square(draw(11)), kChiSquareLimit);
}

double correlation(const std::vector<float>& a, const std::vector<float>& b) {
  double sa = 0, sb = 0, sab = 0, saa = 0, sbb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    sa += a[i], sb += b[i], sab += a[i] * b[i], saa += a[i] * a[i], sbb += b[i] * b[i];
  }
  double n = static_cast<double>(a.size());
  double cov = sab / n - sa / n * sb / n;
  return cov / std::sqrt((saa / n - sa / n * sa / n) * (sbb / n - sb / n * sb / n));
}

TEST(Random, DifferentKeysAreIndependent) {
  // Rank keys of one step, keys one bit apart, and consecutive steps: correlation at the same
  // index stays within 5 standard errors (1/sqrt(n)) of zero, and the pair grid is uniform.
  EncodeContext c0, c1, c2;
  c0.seed = c1.seed = c2.seed = 42;
  c1.rank = 1;
  c2.step = 1;
  const double bound = 5 / std::sqrt(static_cast<double>(kN));
  std::vector<std::pair<std::uint64_t, std::uint64_t>> pairs = {
      {c0.rank_key(), c1.rank_key()}, {c0.rank_key(), c2.rank_key()},
      {c0.rank_key(), c0.shared_key()}, {0, 1}, {0, std::uint64_t{1} << 32}, {5, 5 ^ (1ull << 63)}};
  for (auto [ka, kb] : pairs) {
    auto a = draw(ka), b = draw(kb);
    EXPECT_LT(std::fabs(correlation(a, b)), bound) << ka << " " << kb;
    std::vector<int> grid(256);
    for (std::size_t i = 0; i < kN; ++i) {
      ++grid[static_cast<int>(a[i] * 16) * 16 + static_cast<int>(b[i] * 16)];
    }
    EXPECT_LT(chi_square(grid, kN / 256.0), kChiSquareLimit) << ka << " " << kb;
  }
}

TEST(Random, NoiseCanFailTheseTests) {
  // The statistics above with their limits reject broken generators: a lag-1 correlated stream
  // fails the correlation bound, and the mean of neighbours (correlated, triangular) fails the
  // pair grid and the buckets.
  auto a = draw(1);
  std::vector<float> b(a.size()), mean(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    b[i] = 0.9f * a[i] + 0.1f * a[(i + 1) % a.size()];
    mean[i] = 0.5f * (a[i] + a[(i + 1) % a.size()]);
  }
  EXPECT_GT(std::fabs(correlation(a, b)), 5 / std::sqrt(static_cast<double>(kN)));
  EXPECT_GT(pairs_chi_square(mean), kChiSquareLimit);
  EXPECT_GT(buckets_chi_square(mean), kChiSquareLimit);
  // A stream stuck in half of [0, 1) fails the buckets.
  std::vector<float> half(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) half[i] = 0.5f * a[i];
  EXPECT_GT(buckets_chi_square(half), kChiSquareLimit);
}

}  // namespace
}  // namespace terse::kit
