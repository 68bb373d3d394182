#include <gtest/gtest.h>

#include <cmath>

#include "codec_testing.h"
#include "kit/random.h"

namespace terse {
namespace {

// Scalar reference from the documented format.
std::vector<std::uint8_t> reference(const std::vector<float>& x, std::uint64_t key) {
  std::uint32_t mx = 0;
  for (float v : x) {
    std::uint32_t b;
    std::memcpy(&b, &v, 4);
    mx = std::max(mx, b & 0x7fffffffu);
  }
  int top = std::min<int>(254, static_cast<int>((mx + 0x7fffffu) >> 23));
  int low = std::max(1, top - 126);
  std::vector<std::uint8_t> out = {static_cast<std::uint8_t>(low)};
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::uint32_t b;
    std::memcpy(&b, &x[i], 4);
    int e = static_cast<int>((b >> 23) & 255);
    std::uint32_t m = b & 0x7fffffu;
    std::uint32_t bits = kit::random_bits(key, i);
    int c;
    if (e >= low) {
      c = std::min(254, e + ((bits >> 9) < m ? 1 : 0)) - low + 1;
    } else {
      float p = std::fabs(x[i]) * std::ldexp(1.0f, 127 - low);
      c = kit::uniform_at(key, i) < p ? 1 : 0;
    }
    out.push_back(c == 0 ? 0 : static_cast<std::uint8_t>(c | (b >> 31) << 7));
  }
  return out;
}

TEST(Natural, KnownVector) {
  auto c = make_codec("natural");
  // Top exponent 128 (2.0, and 1.5 may round up to 2), so the window starts at low = 2 and
  // code = biased exponent - 1. Powers of two and zeros are exact: 1.0 -> 0x7e, -2 -> 0xff,
  // 0.5 -> 0x7d, +-0 -> 0x00. 2^-126 lies below the window (2^-125): 0 or 2^-125 at odds 1:1.
  // 1.5 rounds to 1 (0x7e) or 2 (0x7f) at odds 1:1.
  std::vector<float> x = {1.0f, -2.0f, 0.5f, 0.0f, -0.0f, 0x1p-126f, 1.5f};
  auto e = testing::encode(*c, x);
  EXPECT_EQ(testing::payload_hex(e), "027eff7d0000017f");
}

TEST(Natural, MatchesScalarReference) {
  for (std::size_t n : {1, 7, 16, 17, 100, 4097}) {
    auto x = testing::gradient(n, n);
    if (n > 10) x[3] = 1e-42f, x[5] = -3e-39f, x[7] = 0x1p-149f;  // subnormals
    auto e = testing::encode(*make_codec("natural"), x, 5);
    std::vector<std::uint8_t> p(e.bytes.size() - 24);
    std::memcpy(p.data(), e.bytes.data() + 24, p.size());
    ASSERT_EQ(p, reference(x, testing::rank_key(5))) << n;
  }
  // A wide range: values far below max * 2^-126 use the below-window rule.
  std::vector<float> wide = {1e30f, 1e-10f, -1e-20f, 3e-30f, 1.0f, -5e-38f};
  auto e = testing::encode(*make_codec("natural"), wide, 1);
  std::vector<std::uint8_t> p(e.bytes.size() - 24);
  std::memcpy(p.data(), e.bytes.data() + 24, p.size());
  EXPECT_EQ(p, reference(wide, testing::rank_key(1)));
}

TEST(Natural, RoundsToANeighbouringPowerOfTwo) {
  auto x = testing::gradient(10000, 3);
  auto y = testing::round_trip(*make_codec("natural"), x);
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (x[i] == 0) {
      ASSERT_EQ(y[i], 0.0f);
      continue;
    }
    int ex;
    std::frexp(std::fabs(x[i]), &ex);  // |x| in [2^(ex-1), 2^ex)
    float lo = std::ldexp(1.0f, ex - 1), hi = std::ldexp(1.0f, ex);
    ASSERT_TRUE(std::fabs(y[i]) == lo || std::fabs(y[i]) == hi) << i;
    ASSERT_EQ(std::signbit(y[i]), std::signbit(x[i])) << i;
    ASSERT_LE(std::fabs(y[i] - x[i]), std::fabs(x[i]));  // relative error below 1 (1/8 var)
  }
}

// Per-element z-scores where the Bernoulli draw is not too rare for a normal approximation
// (steps * min(p, 1-p) >= 5), and a z-score of the summed error over all elements.
void expect_unbiased(const std::vector<float>& x, int steps,
                     const std::vector<double>& variance, const std::vector<double>& p_up) {
  auto c = make_codec("natural");
  std::vector<double> mean(x.size());
  for (int t = 0; t < steps; ++t) {
    auto y = testing::round_trip(*c, x, static_cast<std::uint64_t>(t));
    for (std::size_t i = 0; i < x.size(); ++i) mean[i] += y[i];
  }
  double z2 = 0, total = 0, total_var = 0;
  std::size_t k = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    mean[i] /= steps;
    if (variance[i] == 0) {
      ASSERT_EQ(mean[i], x[i]) << i;
      continue;
    }
    total += mean[i] - x[i];
    total_var += variance[i] / steps;
    if (steps * std::min(p_up[i], 1 - p_up[i]) < 5) continue;
    double z = (mean[i] - x[i]) / std::sqrt(variance[i] / steps);
    ASSERT_LT(std::fabs(z), 6.0) << i << " x=" << x[i] << " mean=" << mean[i];
    z2 += z * z;
    ++k;
  }
  EXPECT_LT(std::fabs(total) / std::sqrt(total_var), 5.0);
  if (k == 0) return;
  EXPECT_LT(z2, k + 6 * std::sqrt(2.0 * k));
  EXPECT_GT(z2, k - 6 * std::sqrt(2.0 * k));
}

TEST(Natural, UnbiasedOverSteps) {
  auto x = testing::gradient(2000, 8);
  std::vector<double> var(x.size()), p(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    int ex;
    double a = std::fabs(x[i]);
    std::frexp(a, &ex);
    double lo = std::ldexp(1.0, ex - 1);
    var[i] = a == 0 ? 0 : (2 * lo - a) * (a - lo);
    p[i] = a == 0 ? 0 : (a - lo) / lo;
  }
  expect_unbiased(x, 2000, var, p);
}

TEST(Natural, SubnormalsAndTinyValuesAreUnbiased) {
  // All subnormal: window base 2^-126; each rounds to 0 or 2^-126 with probability |x|/2^-126.
  std::vector<float> sub = {1e-40f, -3e-39f, 0x1p-149f, 5e-39f, -1e-45f, 1.1e-38f};
  std::vector<double> var, p;
  for (float v : sub) {
    double a = std::fabs(v), u = std::ldexp(1.0, -126);
    var.push_back(a < u ? a * (u - a) : 0);
    p.push_back(a / u);
  }
  expect_unbiased(sub, 20000, var, p);
  // Far below the largest value (window of 127 octaves): 2^-110 next to 2^30.
  std::vector<float> wide = {0x1p30f, 0x1.8p-110f, -0x1.4p-120f, 3e-36f};
  // top = 157 (2^30), low = 31: the window's smallest power is 2^(31-127) = 2^-96.
  std::vector<double> wvar = {0}, wp = {0};
  for (std::size_t i = 1; i < wide.size(); ++i) {
    double a = std::fabs(wide[i]), u = std::ldexp(1.0, -96);
    wvar.push_back(a < u ? a * (u - a) : 0);
    wp.push_back(a / u);
  }
  expect_unbiased(wide, 20000, wvar, wp);
}

TEST(Natural, HugeValuesRoundDownToTwoPow127) {
  auto y = testing::round_trip(*make_codec("natural"), std::vector<float>{3e38f, -2e38f, 0x1p127f});
  EXPECT_EQ(y[0], 0x1p127f);
  EXPECT_EQ(y[1], -0x1p127f);
  EXPECT_EQ(y[2], 0x1p127f);
}

TEST(Natural, CompressionRatioAndBadWindow) {
  auto c = make_codec("natural");
  auto x = testing::gradient(1 << 20);
  auto e = testing::encode(*c, x);
  EXPECT_EQ(e.bytes.size(), 24 + 1 + x.size());
  for (int low : {0, 129, 255}) {
    auto bad = e.bytes;
    bad[24] = static_cast<std::byte>(low);
    std::vector<float> y(x.size());
    EXPECT_THROW(c->decode(bad, y), DecodeError) << low;
  }
  EXPECT_THROW(make_codec("natural:bits=9"), SpecError);
}

}  // namespace
}  // namespace terse
