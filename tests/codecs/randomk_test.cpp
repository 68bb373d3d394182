#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>

#include "codec_testing.h"
#include "kit/random.h"

namespace terse {
namespace {

// Positions the decoder wrote a nonzero value to.
std::vector<std::size_t> support(const std::vector<float>& y) {
  std::vector<std::size_t> s;
  for (std::size_t i = 0; i < y.size(); ++i) {
    if (y[i] != 0.0f) s.push_back(i);
  }
  return s;
}

// Gradient-like values without zeros, so the support of a decode is its index set.
std::vector<float> nonzero(std::size_t n, std::uint64_t seed) {
  auto x = testing::gradient(n, seed);
  for (auto& v : x) v = v == 0.0f ? 1e-3f : v;
  return x;
}

EncodeContext context(std::uint64_t step, std::uint64_t rank = 0) {
  EncodeContext ctx;
  ctx.seed = 1234;
  ctx.step = step;
  ctx.tensor = 99;
  ctx.rank = rank;
  return ctx;
}

TEST(RandomK, KnownVector) {
  auto c = make_codec("randomk:ratio=0.5");
  std::vector<float> x = {0.5f, -3.0f, 0.0f, 2.0f, -2.0f, 1.0f, 4.0f, -0.25f};
  auto e = testing::encode(*c, x);
  // The u64 key (seed 1234, step 0, tensor 99), then x at the indices it draws.
  const std::uint64_t key = context(0).shared_key();
  std::vector<std::uint32_t> idx(4);
  kit::random_k_indices(key, 8, 4, idx.data());
  EXPECT_EQ(idx, (std::vector<std::uint32_t>{1, 2, 5, 7}));
  // Values -3, 0, 1, -0.25.
  EXPECT_EQ(testing::payload_hex(e),
            "e9126665edf4331a" "000040c0" "00000000" "0000803f" "000080be");
  auto scaled = testing::encode(*make_codec("randomk:ratio=0.5,scale=1"), x);  // values * 2
  EXPECT_EQ(testing::payload_hex(scaled),
            "e9126665edf4331a" "0000c0c0" "00000000" "00000040" "000000bf");
}

TEST(RandomK, SameIndicesOnEveryRankWhateverTheData) {
  auto c = make_codec("randomk:ratio=0.05");
  const std::size_t n = 5000, k = 250;
  for (std::uint64_t step = 0; step < 5; ++step) {
    std::vector<std::vector<std::size_t>> supports;
    for (std::uint64_t rank = 0; rank < 4; ++rank) {
      auto ctx = context(step, rank);
      auto x = nonzero(n, 10 * step + rank);
      auto y = testing::decode(*c, testing::encode(*c, x, ctx).span(), n);
      supports.push_back(support(y));
      ASSERT_EQ(supports.back().size(), k);
      for (std::size_t i : supports.back()) ASSERT_EQ(y[i], x[i]);  // unscaled values
    }
    for (const auto& s : supports) EXPECT_EQ(s, supports[0]) << "step " << step;
  }
  auto a = context(0), b = context(1);
  auto x = nonzero(n, 1);
  EXPECT_NE(support(testing::decode(*c, testing::encode(*c, x, a).span(), n)),
            support(testing::decode(*c, testing::encode(*c, x, b).span(), n)));
}

TEST(RandomK, ScaledIsUnbiased) {
  // ratio 0.1 scaled by n/k = 10: element i decodes to 10 x_i with probability 1/10, else 0.
  auto c = make_codec("randomk:ratio=0.1,scale=1");
  EXPECT_TRUE(c->traits().unbiased);
  EXPECT_FALSE(make_codec("randomk")->traits().unbiased);
  const std::size_t n = 300;
  const int steps = 6000;
  auto x = nonzero(n, 3);
  std::vector<double> mean(n);
  for (int t = 0; t < steps; ++t) {
    auto y = testing::round_trip(*c, x, static_cast<std::uint64_t>(t));
    for (std::size_t i = 0; i < n; ++i) mean[i] += y[i];
  }
  double z2 = 0;
  for (std::size_t i = 0; i < n; ++i) {
    mean[i] /= steps;
    const double se = std::fabs(x[i]) * std::sqrt((10.0 - 1.0) / steps);
    const double z = (mean[i] - x[i]) / se;
    ASSERT_LT(std::fabs(z), 6.0) << i;
    z2 += z * z;
  }
  EXPECT_LT(z2, n + 6 * std::sqrt(2.0 * n));  // chi-square(n)
  EXPECT_GT(z2, n - 6 * std::sqrt(2.0 * n));
}

TEST(RandomK, CombineAddsEncodingsOfTheSameStep) {
  auto c = make_codec("randomk:ratio=0.1,scale=1");
  EXPECT_TRUE(c->traits().summable);
  const std::size_t n = 1001;
  auto c0 = context(7, 0), c1 = context(7, 1), c2 = context(7, 2);
  auto e0 = testing::encode(*c, nonzero(n, 1), c0), e1 = testing::encode(*c, nonzero(n, 2), c1),
       e2 = testing::encode(*c, nonzero(n, 3), c2);
  auto y0 = testing::decode(*c, e0.span(), n), y1 = testing::decode(*c, e1.span(), n),
       y2 = testing::decode(*c, e2.span(), n);
  auto acc = e0.bytes;
  c->combine(e1.span(), acc);
  c->combine(e2.span(), acc);
  auto sum = testing::decode(*c, acc, n);
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(sum[i], (y0[i] + y1[i]) + y2[i]) << i;

  auto other_step = context(8, 1);
  auto late = testing::encode(*c, nonzero(n, 2), other_step);
  EXPECT_THROW(c->combine(late.span(), acc), DecodeError);
  auto bad = e1.bytes;
  float nan = NAN;
  std::memcpy(bad.data() + 24 + 8, &nan, 4);
  EXPECT_THROW(c->combine(bad, acc), DecodeError);
  EXPECT_THROW(c->combine(std::span(e1.bytes).first(e1.bytes.size() - 4), acc), DecodeError);
  auto unscaled = make_codec("randomk:ratio=0.1");
  EXPECT_THROW(unscaled->combine(e1.span(), acc), DecodeError);  // other parameters
  // Sums saturate instead of overflowing to Inf.
  std::vector<float> big(n, 3e38f);
  auto b0 = testing::encode(*c, big, c0), b1 = testing::encode(*c, big, c1);
  c->combine(b1.span(), b0.bytes);
  for (float v : testing::decode(*c, b0.span(), n)) ASSERT_TRUE(v == 0.0f || v == FLT_MAX);
}

TEST(RandomK, CompressionRatio) {
  auto x = testing::gradient(1 << 20);
  auto e = testing::encode(*make_codec("randomk"), x);
  EXPECT_EQ(e.bytes.size(), 24u + 8 + 4 * 10486);  // k = round(0.01 * 2^20), no indices
  EXPECT_GT(4.0 * x.size() / e.bytes.size(), 99.9);
}

TEST(RandomK, EdgeCases) {
  auto c = make_codec("randomk:scale=1");
  auto empty = testing::encode(*c, std::vector<float>{});
  EXPECT_EQ(empty.bytes.size(), 24u + 8);
  std::vector<float> one = {-2.5f};  // k = 1 = n: scale 1
  EXPECT_EQ(testing::round_trip(*c, one), one);
  auto x = nonzero(100, 5);
  EXPECT_EQ(testing::round_trip(*make_codec("randomk:ratio=1,scale=1"), x), x);
  std::vector<float> huge(50, 3e38f);  // scaled by 50: saturates
  for (float v : testing::round_trip(*c, huge)) EXPECT_TRUE(v == 0.0f || v == FLT_MAX);
}

TEST(RandomK, RejectsCorruptPayloads) {
  auto c = make_codec("randomk:ratio=0.1");
  auto x = nonzero(300, 3);
  auto e = testing::encode(*c, x);
  std::vector<float> y(x.size());
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    for (std::size_t at : {0, 13, 29}) {
      auto b = e.bytes;
      std::memcpy(b.data() + 24 + 8 + 4 * at, &bad, 4);
      EXPECT_THROW(c->decode(b, y), DecodeError) << bad << " at " << at;
    }
  }
  // Any key is a valid key: it names another index set, which is still in range.
  auto b = e.bytes;
  b[24] ^= std::byte{0x5a};
  EXPECT_NO_THROW(c->decode(b, y));
  EXPECT_EQ(support(y).size(), 30u);
}

TEST(RandomK, RejectsInvalidParameters) {
  for (const char* bad : {"randomk:ratio=0", "randomk:ratio=1.01", "randomk:scale=2",
                          "randomk:seed=3"}) {
    EXPECT_THROW(make_codec(bad), SpecError) << bad;
  }
  EXPECT_EQ(make_codec("randomk")->spec(), "randomk:ratio=0.01,scale=0");
}

}  // namespace
}  // namespace terse
