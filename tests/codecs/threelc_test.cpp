#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "codec_testing.h"

namespace terse {
namespace {

TEST(ThreeLc, KnownVector) {
  auto c = make_codec("threelc");
  std::vector<float> x = {1.0f, 0, 0, -0.6f, 0, 0, 0.2f, 0, 0, 0, 0, 0.5f};
  auto e = testing::encode(*c, x);
  // M = 1; 12 elements -> 3 bytes, byte j = elements j, j+3, j+6, j+9, j+12 (padding) as digits
  // (value + 1), first most significant: 2,0,1,1,1 = 175; all zero = 121; 1,1,1,2,1 = 124.
  EXPECT_EQ(testing::payload_hex(e), "0000803faf797c");
  auto y = testing::decode(*c, e.span(), x.size());
  std::vector<float> expect = {1, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0, 1};
  EXPECT_EQ(y, expect);
}

TEST(ThreeLc, KnownVectorZeroRuns) {
  auto c = make_codec("threelc");
  std::vector<float> x(1000, 0.0f);
  x[0] = 1.0f;
  auto e = testing::encode(*c, x);
  // byte 0 = digits 2,1,1,1,1 = 202; then 199 bytes of 121 = 14 runs of 14 (255) + a run of 3 (244).
  std::string expect = "0000803fca";
  for (int i = 0; i < 14; ++i) expect += "ff";
  expect += "f4";
  EXPECT_EQ(testing::payload_hex(e), expect);
  auto y = testing::decode(*c, e.span(), x.size());
  EXPECT_EQ(y, x);
}

// Decoded values are exactly q * M with q = round(x / M), ties away from zero.
TEST(ThreeLc, MatchesDefinitionAndErrorBound) {
  for (const char* spec : {"threelc", "threelc:sparsity=1.5", "threelc:sparsity=1.999"}) {
    auto c = make_codec(spec);
    double s = std::string(spec) == "threelc" ? 1.0 : std::stod(std::string(spec).substr(17));
    for (std::size_t n : {1, 4, 5, 6, 319, 320, 321, 5119, 5120, 5121, 20000}) {
      auto x = testing::gradient(n, n + 7);
      float amax = 0;
      for (float v : x) amax = std::max(amax, std::fabs(v));
      float m = static_cast<float>(amax * s);
      auto y = testing::round_trip(*c, x);
      for (std::size_t i = 0; i < n; ++i) {
        float q = std::fabs(x[i]) >= m * 0.5f ? (x[i] > 0 ? 1.0f : -1.0f) : 0.0f;
        ASSERT_EQ(y[i], q * m) << spec << " n=" << n << " i=" << i;
        ASSERT_LE(std::fabs(y[i] - x[i]), m * 0.5f * 1.000001f);
      }
    }
  }
}

TEST(ThreeLc, SparseBlocksAreSkippedAndZeroFilled) {
  auto c = make_codec("threelc");
  std::vector<float> x(3 * 5120 + 77, 0.001f);
  x[5120 + 33] = -1.0f;
  x.back() = 0.9f;
  auto y = testing::round_trip(*c, x);  // y starts as -7
  for (std::size_t i = 0; i < x.size(); ++i) {
    float expect = i == 5120 + 33 ? -1.0f : (i + 1 == x.size() ? 1.0f : 0.0f);
    ASSERT_EQ(y[i], expect) << i;
  }
}

TEST(ThreeLc, CompressionRatio) {
  std::vector<float> zeros(1 << 20, 0.0f);
  // 209716 bytes of 121 -> 14979 runs of 14 and one of 10.
  EXPECT_EQ(testing::encode(*make_codec("threelc"), zeros).bytes.size(), 24u + 4 + 14980);
  auto x = testing::gradient(1 << 20);
  auto size = testing::encode(*make_codec("threelc"), x).bytes.size();
  EXPECT_LE(size, 24u + 4 + (1u << 20) / 5 + 1);  // never above 1.6 bits/element
  EXPECT_LT(size, 24u + 4 + (1u << 20) / 10);     // gradients are mostly zeros
}

TEST(ThreeLc, RejectsInvalidParameters) {
  EXPECT_THROW(make_codec("threelc:sparsity=2"), SpecError);
  EXPECT_THROW(make_codec("threelc:sparsity=0.5"), SpecError);
  EXPECT_THROW(make_codec("threelc:sparsity=x"), SpecError);
  EXPECT_NO_THROW(make_codec("threelc:sparsity=1.99"));
}

TEST(ThreeLc, RejectsBadStreams) {
  auto c = make_codec("threelc");
  std::vector<float> x(1000, 0.0f);
  x[0] = 1.0f;
  auto e = testing::encode(*c, x);
  std::vector<float> y(x.size());
  auto b = e.bytes;
  b.back() = std::byte{245};  // run of 4 instead of 3: overflows n
  EXPECT_THROW(c->decode(b, y), DecodeError);
  b = e.bytes;
  b.back() = std::byte{243};  // run of 2: too short
  EXPECT_THROW(c->decode(b, y), DecodeError);
  for (float bad : {-1.0f, NAN, INFINITY}) {
    b = e.bytes;
    std::memcpy(b.data() + 24, &bad, 4);
    EXPECT_THROW(c->decode(b, y), DecodeError) << bad;
  }
  // Padding positions must be zero: 12 elements use 3 bytes with 3 padding positions.
  std::vector<float> small = {1.0f, 0, 0, -0.6f, 0, 0, 0.2f, 0, 0, 0, 0, 0.5f};
  auto es = testing::encode(*c, small);
  es.bytes[28] = std::byte{176};  // byte 0: padding digit 2
  std::vector<float> ys(small.size());
  EXPECT_THROW(c->decode(es.bytes, ys), DecodeError);
}

}  // namespace
}  // namespace terse
