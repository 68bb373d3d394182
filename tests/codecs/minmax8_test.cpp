#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "codec_testing.h"

namespace terse {
namespace {

TEST(MinMax8, KnownVector) {
  auto c = make_codec("minmax8:chunk=8");
  std::vector<float> x = {-1, 0, 1, 0.5f, -0.5f, 0.25f, 1, -1, 3, 3};
  auto e = testing::encode(*c, x);
  // (min, max) = (-1, 1), (3, 3); codes round((x + 1) * 127.5), ties to even: 127.5 -> 128.
  EXPECT_EQ(testing::payload_hex(e), "000080bf0000803f0000404000004040" "0080ffbf409fff00" "0000");
  auto y = testing::decode(*c, e.span(), x.size());
  EXPECT_EQ(y[0], -1.0f);
  EXPECT_EQ(y[2], 1.0f);
  EXPECT_EQ(y[8], 3.0f);
}

TEST(MinMax8, KnownVectorFourBits) {
  auto c = make_codec("minmax8:bits=4,chunk=8");
  std::vector<float> x = {0, 1, 2, 3, 4, 5, 6, 7.5f, -2};
  auto e = testing::encode(*c, x);
  // step 0.5: codes 0 2 4 6 8 10 12 15 packed low nibble first; the last chunk is constant.
  EXPECT_EQ(testing::payload_hex(e), "000000000000f040000000c0000000c0" "2064a8fc00");
  auto y = testing::decode(*c, e.span(), x.size());
  std::vector<float> expect = {0, 1, 2, 3, 4, 5, 6, 7.5f, -2};
  EXPECT_EQ(y, expect);
}

TEST(MinMax8, ErrorBoundEveryBitWidth) {
  for (unsigned bits = 1; bits <= 8; ++bits) {
    for (std::size_t chunk : {8, 40, 4096}) {
      std::string spec = "minmax8:bits=" + std::to_string(bits) + ",chunk=" + std::to_string(chunk);
      auto c = make_codec(spec);
      for (std::size_t n : {1, 5, 13, 4097, 10001}) {
        auto x = testing::gradient(n, bits * 100 + n);
        auto e = testing::encode(*c, x);
        ASSERT_EQ(e.bytes.size(), 24 + 8 * ((n + chunk - 1) / chunk) + (n * bits + 7) / 8);
        auto y = testing::decode(*c, e.span(), n);
        for (std::size_t s = 0; s < n; s += chunk) {
          std::size_t end = std::min(n, s + chunk);
          float lo = *std::min_element(x.begin() + s, x.begin() + end);
          float hi = *std::max_element(x.begin() + s, x.begin() + end);
          double half_step = (static_cast<double>(hi) - lo) / ((1u << bits) - 1) / 2;
          for (std::size_t i = s; i < end; ++i) {
            ASSERT_GE(y[i], lo);
            ASSERT_LE(y[i], hi);
            ASSERT_LE(std::fabs(static_cast<double>(y[i]) - x[i]), half_step * 1.0001 + 1e-12)
                << spec << " n=" << n << " i=" << i;
          }
        }
      }
    }
  }
}

TEST(MinMax8, ExtremeRangesStayWithinBounds) {
  auto c = make_codec("minmax8:chunk=8");
  std::vector<float> x = {3e38f, -3e38f, 0, 1, 1e38f, -1e38f, 2e38f, 5};
  auto y = testing::round_trip(*c, x);
  double half_step = 6e38 / 255 / 2;
  for (std::size_t i = 0; i < x.size(); ++i) {
    ASSERT_TRUE(std::isfinite(y[i]));
    ASSERT_LE(std::fabs(static_cast<double>(y[i]) - x[i]), half_step * 1.0001) << i;
  }
  std::vector<float> tiny = {1e-45f, 0, 3e-45f, 2e-45f, 0, 1e-45f, 0, 0};
  auto t = testing::round_trip(*make_codec("minmax8:chunk=8,bits=2"), tiny);
  EXPECT_EQ(t, tiny);  // 4 codes for 4 subnormal values: exact
}

TEST(MinMax8, CompressionRatio) {
  auto x = testing::gradient(1 << 20);
  EXPECT_EQ(testing::encode(*make_codec("minmax8"), x).bytes.size(),
            24u + 8 * 256 + (1u << 20));  // ~3.99x
  EXPECT_EQ(testing::encode(*make_codec("minmax8:bits=4"), x).bytes.size(),
            24u + 8 * 256 + (1u << 19));  // ~7.97x
}

TEST(MinMax8, RejectsInvalidParameters) {
  EXPECT_THROW(make_codec("minmax8:bits=0"), SpecError);
  EXPECT_THROW(make_codec("minmax8:bits=9"), SpecError);
  EXPECT_THROW(make_codec("minmax8:chunk=4"), SpecError);
  EXPECT_THROW(make_codec("minmax8:chunk=12"), SpecError);
  EXPECT_THROW(make_codec("minmax8:chunk=0"), SpecError);
}

TEST(MinMax8, RejectsBadRangesAndPadding) {
  auto c = make_codec("minmax8:bits=4,chunk=8");
  std::vector<float> x = {0, 1, 2, 3, 4, 5, 6, 7.5f, -2};
  auto e = testing::encode(*c, x);
  std::vector<float> y(x.size());
  for (auto [lo, hi] : {std::pair{1.0f, 0.0f}, {NAN, 1.0f}, {0.0f, INFINITY}}) {
    auto b = e.bytes;
    std::memcpy(b.data() + 24, &lo, 4);
    std::memcpy(b.data() + 28, &hi, 4);
    EXPECT_THROW(c->decode(b, y), DecodeError) << lo << " " << hi;
  }
  auto b = e.bytes;
  b.back() |= std::byte{0x10};
  EXPECT_THROW(c->decode(b, y), DecodeError);
}

}  // namespace
}  // namespace terse
