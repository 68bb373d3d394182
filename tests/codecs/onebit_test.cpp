#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "codec_testing.h"

namespace terse {
namespace {

TEST(OneBit, KnownVector) {
  std::vector<float> x = {1, -2, 3, -4, 0, 5, -6, 7, -1, -1, 2, 2};
  auto c = make_codec("onebit:chunk=8");
  auto e = testing::encode(*c, x);
  // scales 28/8 = 3.5 (0x40600000) and 6/4 = 1.5 (0x3fc00000); sign bits 0b01001010, 0b0011.
  EXPECT_EQ(testing::payload_hex(e), "000060400000c03f4a03");
  auto y = testing::decode(*c, e.span(), x.size());
  std::vector<float> expect = {3.5, -3.5, 3.5, -3.5, 3.5, 3.5, -3.5, 3.5, -1.5, -1.5, 1.5, 1.5};
  EXPECT_EQ(y, expect);  // zero is sent as +scale
  auto m = make_codec("onebit:chunk=8,scale=max");
  EXPECT_EQ(testing::payload_hex(testing::encode(*m, x)), "0000e040000000404a03");
}

// Signs exact, each chunk's magnitude equal to the mean (or max) |x| of the chunk.
void check_against_reference(const std::string& spec, std::size_t chunk, bool use_max,
                             std::size_t n) {
  auto c = make_codec(spec);
  auto x = testing::gradient(n, n + 3);
  auto y = testing::round_trip(*c, x);
  std::size_t len = chunk == 0 ? n : chunk;
  for (std::size_t s = 0; s < n; s += len) {
    std::size_t e = std::min(n, s + len);
    double sum = 0, mx = 0;
    for (std::size_t i = s; i < e; ++i) {
      sum += std::fabs(x[i]);
      mx = std::max<double>(mx, std::fabs(x[i]));
    }
    double scale = use_max ? mx : sum / static_cast<double>(e - s);
    for (std::size_t i = s; i < e; ++i) {
      ASSERT_EQ(std::signbit(y[i]), x[i] < 0) << spec << " n=" << n << " i=" << i;
      ASSERT_NEAR(std::fabs(y[i]), scale, 1e-6 * scale) << spec << " n=" << n << " i=" << i;
    }
  }
}

TEST(OneBit, MatchesReferenceForOddSizesAndChunks) {
  for (std::size_t n : {1, 7, 9, 63, 64, 65, 1023, 1025, 4097, 10007}) {
    check_against_reference("onebit", 1024, false, n);
    check_against_reference("onebit:chunk=8", 8, false, n);
    check_against_reference("onebit:chunk=0", 0, false, n);
    check_against_reference("onebit:chunk=40,scale=max", 40, true, n);
  }
}

TEST(OneBit, MeanScaleMinimisesL2Error) {
  auto c = make_codec("onebit:chunk=0");
  auto x = testing::gradient(5000, 9);
  auto y = testing::round_trip(*c, x);
  auto err = [&](double f) {
    double e = 0;
    for (std::size_t i = 0; i < x.size(); ++i) e += std::pow(x[i] - f * y[i], 2);
    return e;
  };
  EXPECT_LT(err(1.0), err(1.01));
  EXPECT_LT(err(1.0), err(0.99));
}

TEST(OneBit, CompressionRatio) {
  auto x = testing::gradient(1 << 20);
  EXPECT_EQ(testing::encode(*make_codec("onebit"), x).bytes.size(),
            24u + 4 * 1024 + (1u << 17));  // ~31x
  EXPECT_EQ(testing::encode(*make_codec("onebit:chunk=0"), x).bytes.size(),
            24u + 4 + (1u << 17));  // ~32x
}

TEST(OneBit, ZeroChunkDecodesToZero) {
  std::vector<float> x(24, 0.0f);
  x[20] = -1.0f;
  auto y = testing::round_trip(*make_codec("onebit:chunk=8"), x);
  for (std::size_t i = 0; i < 16; ++i) EXPECT_EQ(y[i], 0.0f);
  EXPECT_EQ(y[20], -0.125f);  // mean |x| of elements 16..23
  EXPECT_EQ(y[21], 0.125f);
}

TEST(OneBit, RejectsInvalidParameters) {
  EXPECT_THROW(make_codec("onebit:chunk=12"), SpecError);
  EXPECT_THROW(make_codec("onebit:chunk=-8"), SpecError);
  EXPECT_THROW(make_codec("onebit:chunk=2147483648"), SpecError);
  EXPECT_THROW(make_codec("onebit:scale=median"), SpecError);
  EXPECT_NO_THROW(make_codec("onebit:chunk=1073741824"));
}

TEST(OneBit, RejectsBadScalesAndPadding) {
  auto c = make_codec("onebit:chunk=8");
  std::vector<float> x = {1, -2, 3, -4, 0, 5, -6, 7, -1, -1, 2, 2};
  auto e = testing::encode(*c, x);
  std::vector<float> y(x.size());
  for (float bad : {-1.0f, -0.0f, NAN, INFINITY}) {
    auto b = e.bytes;
    std::memcpy(b.data() + 24 + 4, &bad, 4);
    EXPECT_THROW(c->decode(b, y), DecodeError) << bad;
  }
  auto b = e.bytes;
  b.back() |= std::byte{0x10};  // element 12 does not exist
  EXPECT_THROW(c->decode(b, y), DecodeError);
}

}  // namespace
}  // namespace terse
