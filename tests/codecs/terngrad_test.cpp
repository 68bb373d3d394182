#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "codec_testing.h"
#include "levels_reference.h"

namespace terse {
namespace {

TEST(TernGrad, KnownVector) {
  auto c = make_codec("terngrad");
  // Scale 1.0 (0000803f); +-1 and 0 are certain: 1 -> code 2, -1 -> 0, 0 -> 1.
  std::vector<float> x = {1.0f, -1.0f, 0.0f, 0.5f, -0.25f, 0.75f, 0.1f, -0.6f, 0.3f};
  auto e = testing::encode(*c, x);
  EXPECT_EQ(testing::payload_hex(e), "0000803f" "521802");
  EXPECT_EQ(e.bytes[24 + 4] & std::byte{0x3f}, std::byte{0x12});  // codes 2, 0, 1
}

TEST(TernGrad, MatchesScalarReference) {
  for (std::size_t chunk : {0, 1, 7, 64, 100, 1000}) {
    for (std::size_t n : {1, 15, 63, 64, 65, 1000, 4099}) {
      auto c = make_codec("terngrad:chunk=" + std::to_string(chunk));
      auto x = testing::gradient(n, n + chunk);
      auto e = testing::encode(*c, x, 3);
      auto ref = testing::reference_levels({false, 1, 2, chunk}, x, testing::rank_key(3));
      ASSERT_EQ(testing::payload(e), ref) << "chunk=" << chunk << " n=" << n;
    }
  }
}

TEST(TernGrad, ValuesAreTernaryWithinTheScale) {
  for (std::size_t chunk : {0, 256}) {
    auto c = make_codec("terngrad:chunk=" + std::to_string(chunk));
    auto x = testing::gradient(5000, 4);
    auto y = testing::round_trip(*c, x);
    std::size_t bucket = chunk == 0 ? x.size() : chunk;
    for (std::size_t s = 0; s < x.size(); s += bucket) {
      float m = 0;
      for (std::size_t i = s; i < std::min(x.size(), s + bucket); ++i) m = std::max(m, std::fabs(x[i]));
      for (std::size_t i = s; i < std::min(x.size(), s + bucket); ++i) {
        ASSERT_TRUE(y[i] == 0 || y[i] == m || y[i] == -m) << i;
        ASSERT_TRUE(y[i] == 0 || std::signbit(y[i]) == std::signbit(x[i])) << i;
        ASSERT_LE(std::fabs(y[i] - x[i]), m) << i;
      }
    }
  }
}

// Mean of T decodes at different steps: every element's z-score |mean - x| / SE is bounded and
// the z-scores' mean square is near 1 (a biased codec fails both).
// Elements where the draw is rare (steps * min(p, 1-p) < 5) are left to the summed z-score, as
// the normal approximation does not hold for them.
void expect_unbiased(const Codec& c, const std::vector<float>& x, int steps,
                     const std::function<double(std::size_t)>& variance,
                     const std::function<double(std::size_t)>& p_up) {
  std::vector<double> mean(x.size());
  for (int t = 0; t < steps; ++t) {
    auto y = testing::round_trip(c, x, static_cast<std::uint64_t>(t));
    for (std::size_t i = 0; i < x.size(); ++i) mean[i] += y[i];
  }
  double z2 = 0, total = 0, total_var = 0;
  std::size_t counted = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    mean[i] /= steps;
    double se = std::sqrt(variance(i) / steps);
    if (se == 0) {
      ASSERT_NEAR(mean[i], x[i], 1e-6 * std::fabs(x[i])) << i;
      continue;
    }
    total += mean[i] - x[i];
    total_var += se * se;
    if (steps * std::min(p_up(i), 1 - p_up(i)) < 5) continue;
    double z = (mean[i] - x[i]) / se;
    ASSERT_LT(std::fabs(z), 6.0) << "element " << i << " x=" << x[i] << " mean=" << mean[i];
    z2 += z * z;
    ++counted;
  }
  EXPECT_LT(std::fabs(total) / std::sqrt(total_var), 5.0);
  // sum z^2 ~ chi-square(counted): mean counted, sd sqrt(2 counted).
  EXPECT_LT(z2, counted + 6 * std::sqrt(2.0 * counted));
  EXPECT_GT(z2, counted - 6 * std::sqrt(2.0 * counted));
}

TEST(TernGrad, UnbiasedOverSteps) {
  auto c = make_codec("terngrad:chunk=100");
  auto x = testing::gradient(1000, 8);
  auto scale = [&](std::size_t i) {
    std::size_t s = i / 100 * 100;
    float m = 0;
    for (std::size_t k = s; k < s + 100; ++k) m = std::max(m, std::fabs(x[k]));
    return static_cast<double>(m);
  };
  expect_unbiased(
      *c, x, 2000,
      [&](std::size_t i) { return std::fabs(x[i]) * (scale(i) - std::fabs(x[i])); },
      [&](std::size_t i) { return std::fabs(x[i]) / scale(i); });
}

TEST(TernGrad, RanksDrawIndependentNoise) {
  auto c = make_codec("terngrad");
  auto x = testing::gradient(4096, 9, 1.0f);
  EncodeContext a, b;
  b.rank = 1;
  auto ea = testing::encode(*c, x, a), eb = testing::encode(*c, x, b);
  EXPECT_NE(ea.bytes, eb.bytes);
  EXPECT_EQ(testing::encode(*c, x, a).bytes, ea.bytes);  // reproducible
}

TEST(TernGrad, CompressionRatio) {
  for (std::size_t n : {1000, 1001, 1002, 1003, 1 << 20}) {
    auto x = testing::gradient(n);
    EXPECT_EQ(testing::encode(*make_codec("terngrad"), x).bytes.size(), 24 + 4 + (n + 3) / 4);
    EXPECT_EQ(testing::encode(*make_codec("terngrad:chunk=512"), x).bytes.size(),
              24 + 4 * ((n + 511) / 512) + n / 512 * 128 + (n % 512 + 3) / 4);
  }
  auto x = testing::gradient(1 << 20);
  double ratio = 4.0 * x.size() / testing::encode(*make_codec("terngrad"), x).bytes.size();
  EXPECT_GT(ratio, 15.99);
}

TEST(TernGrad, ClipBoundsTheScaleAtSigmas) {
  auto x = testing::gradient(10000, 12, 1.0f);  // outliers of 50 sigma
  auto c = make_codec("terngrad:clip=2.5");
  EXPECT_FALSE(c->traits().unbiased);
  EXPECT_TRUE(make_codec("terngrad")->traits().unbiased);
  double s = 0, q = 0;
  for (float v : x) s += v, q += static_cast<double>(v) * v;
  double sigma = std::sqrt(q / x.size() - (s / x.size()) * (s / x.size()));
  auto y = testing::round_trip(*c, x);
  float scale = 0;
  for (float v : y) scale = std::max(scale, std::fabs(v));
  EXPECT_NEAR(scale, 2.5 * sigma, 1e-4 * sigma);
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (std::fabs(x[i]) >= scale) {
      ASSERT_EQ(y[i], std::copysign(scale, x[i])) << i;
    }
  }
}

TEST(TernGrad, EdgeCases) {
  auto c = make_codec("terngrad");
  std::vector<float> tiny = {1e-45f, -1e-45f, 0.0f, 2e-45f};  // subnormal scale
  auto y = testing::round_trip(*c, tiny);
  for (std::size_t i = 0; i < tiny.size(); ++i) {
    ASSERT_TRUE(y[i] == 0 || y[i] == std::copysign(2e-45f, tiny[i])) << i;
  }
  EXPECT_EQ(y[3], 2e-45f);  // |x| = scale is certain
  EXPECT_THROW(make_codec("terngrad:chunk=-1"), SpecError);
  EXPECT_THROW(make_codec("terngrad:clip=-1"), SpecError);
  EXPECT_THROW(make_codec("terngrad:levels=2"), SpecError);
  // Code 3 is never produced and is rejected.
  auto e = testing::encode(*c, std::vector<float>{1, 1, 1, 1});
  e.bytes[28] = std::byte{0xff};
  std::vector<float> out(4);
  EXPECT_THROW(c->decode(e.span(), out), DecodeError);
  // A negative or non-finite scale is rejected.
  e = testing::encode(*c, std::vector<float>{1, 1, 1, 1});
  float bad = -1;
  std::memcpy(e.bytes.data() + 24, &bad, 4);
  EXPECT_THROW(c->decode(e.span(), out), DecodeError);
  bad = INFINITY;
  std::memcpy(e.bytes.data() + 24, &bad, 4);
  EXPECT_THROW(c->decode(e.span(), out), DecodeError);
}

}  // namespace
}  // namespace terse
