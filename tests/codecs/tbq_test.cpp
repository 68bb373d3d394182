#include <gtest/gtest.h>

#include <cmath>

#include "codec_testing.h"

namespace terse {
namespace {

TEST(Tbq, KnownVector) {
  auto c = make_codec("tbq:threshold=0.5");
  std::vector<float> x = {0.6f, -0.6f, 0.5f, -0.5f, 0, 1e9f, -3, 0.1f, 0.7f};
  auto e = testing::encode(*c, x);
  // codes 1 2 0 0 | 0 1 2 0 | 1, two bits each, first element in the low bits.
  EXPECT_EQ(testing::payload_hex(e), "092401");
  auto y = testing::decode(*c, e.span(), x.size());
  std::vector<float> expect = {0.5f, -0.5f, 0, 0, 0, 0.5f, -0.5f, 0, 0.5f};
  EXPECT_EQ(y, expect);
}

TEST(Tbq, MatchesDefinitionForOddSizes) {
  auto c = make_codec("tbq:threshold=0.01");
  for (std::size_t n : {1, 3, 4, 5, 31, 33, 63, 64, 65, 1001}) {
    auto x = testing::gradient(n, n);
    auto y = testing::round_trip(*c, x);
    for (std::size_t i = 0; i < n; ++i) {
      float expect = x[i] > 0.01f ? 0.01f : (x[i] < -0.01f ? -0.01f : 0.0f);
      ASSERT_EQ(y[i], expect) << "n=" << n << " i=" << i;
      // error: |x| if below tau, |x| - tau above it
      ASSERT_LE(std::fabs(y[i] - x[i]), std::max(0.01f, std::fabs(x[i]) - 0.01f) * 1.000001f);
    }
  }
}

TEST(Tbq, CompressionRatioIsSixteen) {
  auto x = testing::gradient(1 << 20);
  EXPECT_EQ(testing::encode(*make_codec("tbq"), x).bytes.size(), 24u + (1u << 18));
}

TEST(Tbq, RejectsInvalidParameters) {
  EXPECT_THROW(make_codec("tbq:threshold=0"), SpecError);
  EXPECT_THROW(make_codec("tbq:threshold=-1"), SpecError);
  EXPECT_THROW(make_codec("tbq:threshold=abc"), SpecError);
  EXPECT_NO_THROW(make_codec("tbq:threshold=1e-30"));
}

TEST(Tbq, RejectsCodeThreeAndPadding) {
  auto c = make_codec("tbq:threshold=0.5");
  std::vector<float> x = {0.6f, -0.6f, 0.5f, -0.5f, 0, 1e9f, -3, 0.1f, 0.7f};
  auto e = testing::encode(*c, x);
  std::vector<float> y(x.size());
  auto b = e.bytes;
  b[24] |= std::byte{0x30};  // element 2 -> code 11
  EXPECT_THROW(c->decode(b, y), DecodeError);
  b = e.bytes;
  b.back() |= std::byte{0x04};  // element 9 does not exist
  EXPECT_THROW(c->decode(b, y), DecodeError);
  // a code 11 deep inside a long payload (vector path)
  auto x2 = testing::gradient(1000, 4);
  auto e2 = testing::encode(*c, x2);
  e2.bytes[24 + 100] = std::byte{0xff};
  std::vector<float> y2(x2.size());
  EXPECT_THROW(c->decode(e2.bytes, y2), DecodeError);
}

}  // namespace
}  // namespace terse
