#include <gtest/gtest.h>

#include <cmath>

#include "codec_testing.h"
#include "levels_reference.h"

namespace terse {
namespace {

TEST(Qsgd, KnownVector) {
  auto c = make_codec("qsgd:levels=7,bucket=4");
  // Bucket 1: {3, 4, 0, 0}: norm 5 = 0x40a00000; levels 7*3/5 = 4.2 and 7*4/5 = 5.6 round
  // stochastically; zeros are code 7. Bucket 2: {-2}: norm 2, level 7 exactly: code 0.
  std::vector<float> x = {3.0f, 4.0f, 0.0f, 0.0f, -2.0f};
  auto e = testing::encode(*c, x);
  EXPECT_EQ(testing::payload_hex(e), "0000a04000000040cb7700");
  EXPECT_EQ(testing::payload_hex(e).substr(0, 16), "0000a04000000040");
  EXPECT_EQ(e.bytes.back(), std::byte{0x00});  // -2 -> code 0
}

TEST(Qsgd, MatchesScalarReference) {
  for (int levels : {1, 2, 7, 8, 100, 127, 128, 255}) {
    for (std::size_t bucket : {0, 5, 64, 512}) {
      for (std::size_t n : {1, 17, 64, 513, 3000}) {
        auto c = make_codec("qsgd:levels=" + std::to_string(levels) +
                            ",bucket=" + std::to_string(bucket));
        auto x = testing::gradient(n, n + levels);
        auto e = testing::encode(*c, x, 2);
        auto ref = testing::reference_levels(
            {true, levels, kit::level_code_width(levels), bucket}, x, testing::rank_key(2));
        ASSERT_EQ(testing::payload(e), ref) << levels << " " << bucket << " " << n;
      }
    }
  }
}

double bucket_norm(const std::vector<float>& x, std::size_t s, std::size_t bucket) {
  double q = 0;
  for (std::size_t i = s; i < std::min(x.size(), s + bucket); ++i) q += double(x[i]) * x[i];
  return std::sqrt(q);
}

TEST(Qsgd, ErrorIsBelowOneLevelStep) {
  for (int levels : {1, 7, 255}) {
    auto c = make_codec("qsgd:bucket=512,levels=" + std::to_string(levels));
    auto x = testing::gradient(5000, 4);
    auto y = testing::round_trip(*c, x);
    for (std::size_t i = 0; i < x.size(); ++i) {
      double step = bucket_norm(x, i / 512 * 512, 512) / levels;
      ASSERT_LE(std::fabs(y[i] - x[i]), step * (1 + 1e-5)) << i;
      ASSERT_TRUE(y[i] == 0 || std::signbit(y[i]) == std::signbit(x[i])) << i;
    }
  }
}

TEST(Qsgd, UnbiasedOverStepsAndWithinTheVarianceBound) {
  for (int levels : {1, 4, 255}) {
    const std::size_t n = 2048, bucket = 512;
    auto c = make_codec("qsgd:bucket=512,levels=" + std::to_string(levels));
    auto x = testing::gradient(n, 8);
    const int steps = 1500;
    std::vector<double> mean(n);
    double sq_err = 0;
    for (int t = 0; t < steps; ++t) {
      auto y = testing::round_trip(*c, x, static_cast<std::uint64_t>(t));
      for (std::size_t i = 0; i < n; ++i) {
        mean[i] += y[i];
        sq_err += (double(y[i]) - x[i]) * (double(y[i]) - x[i]);
      }
    }
    sq_err /= steps;
    double z2 = 0, expected_err = 0, bound = 0, total = 0, total_var = 0;
    std::size_t counted = 0;
    for (std::size_t i = 0; i < n; ++i) {
      double norm = bucket_norm(x, i / bucket * bucket, bucket);
      double step = norm / levels, a = std::fabs(x[i]) / step, f = a - std::floor(a);
      double v = step * step * f * (1 - f);  // Bernoulli between two levels
      expected_err += v;
      mean[i] /= steps;
      total += mean[i] - x[i];
      total_var += v / steps;
      if (steps * std::min(f, 1 - f) < 5) continue;  // too rare for a normal approximation
      ++counted;
      double z = (mean[i] - x[i]) / std::sqrt(v / steps);
      ASSERT_LT(std::fabs(z), 6.0) << "levels " << levels << " element " << i;
      z2 += z * z;
      if (i % bucket == 0) {  // Lemma 3.1: E||Q(v)-v||^2 <= min(n/s^2, sqrt(n)/s) ||v||^2
        double nb = static_cast<double>(std::min(bucket, n - i));
        bound += std::min(nb / (levels * levels), std::sqrt(nb) / levels) * norm * norm;
      }
    }
    EXPECT_LT(std::fabs(total) / std::sqrt(total_var), 5.0) << levels;
    EXPECT_LT(z2, counted + 6 * std::sqrt(2.0 * counted)) << levels;
    EXPECT_GT(z2, counted - 6 * std::sqrt(2.0 * counted)) << levels;
    EXPECT_LE(sq_err, bound) << levels;
    EXPECT_NEAR(sq_err, expected_err, 0.05 * expected_err) << levels;
  }
}

TEST(Qsgd, CompressionRatio) {
  auto x = testing::gradient(1 << 20);
  auto size = [&](const char* spec) { return testing::encode(*make_codec(spec), x).bytes.size(); };
  const std::size_t n = x.size(), buckets = n / 512;
  EXPECT_EQ(size("qsgd"), 24 + 4 * buckets + n / 2);              // 7 levels: 4 bits
  EXPECT_EQ(size("qsgd:levels=1"), 24 + 4 * buckets + n / 4);     // 2 bits
  EXPECT_EQ(size("qsgd:levels=127"), 24 + 4 * buckets + n);       // 8 bits
  EXPECT_EQ(size("qsgd:levels=255"), 24 + 4 * buckets + 2 * n);   // 16 bits
  EXPECT_EQ(size("qsgd:bucket=0"), 24 + 4 + n / 2);
  EXPECT_EQ(testing::encode(*make_codec("qsgd:bucket=100"), std::vector<float>(1001, 1.0f))
                .bytes.size(),
            24 + 4 * 11 + 10 * 50 + 1);
}

TEST(Qsgd, EdgeCases) {
  EXPECT_THROW(make_codec("qsgd:levels=0"), SpecError);
  EXPECT_THROW(make_codec("qsgd:levels=256"), SpecError);
  EXPECT_THROW(make_codec("qsgd:bucket=-1"), SpecError);
  EXPECT_THROW(make_codec("qsgd:chunk=5"), SpecError);
  // A bucket of one element is exact: |x| = norm, level s.
  auto one = make_codec("qsgd:bucket=1,levels=3");
  std::vector<float> x = {0.1f, -7.0f, 0.0f, 1e-40f, 3e38f};
  auto y = testing::round_trip(*one, x);
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_FLOAT_EQ(y[i], x[i]) << i;
  // Norm overflow: two values of 3e38 in a bucket; the result stays finite.
  auto c = make_codec("qsgd:levels=1");
  auto big = testing::round_trip(*c, std::vector<float>{3e38f, -3e38f, 1.0f});
  for (float v : big) EXPECT_TRUE(std::isfinite(v));
  // Codes above 2s are rejected (levels=5 uses 4 bits: codes 11..15 are invalid).
  auto five = make_codec("qsgd:levels=5,bucket=0");
  auto e = testing::encode(*five, std::vector<float>{1, 2, 3});
  e.bytes[28] = std::byte{0xff};
  std::vector<float> out(3);
  EXPECT_THROW(five->decode(e.span(), out), DecodeError);
  e = testing::encode(*five, std::vector<float>{1, 2, 3});
  float nan = NAN;
  std::memcpy(e.bytes.data() + 24, &nan, 4);
  EXPECT_THROW(five->decode(e.span(), out), DecodeError);
}

}  // namespace
}  // namespace terse
