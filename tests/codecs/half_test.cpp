#include <gtest/gtest.h>

#include <cmath>

#include "codec_testing.h"

namespace terse {
namespace {

TEST(Fp16, KnownVector) {
  auto c = make_codec("fp16");
  std::vector<float> x = {0.0f, 1.0f, -2.0f, 65504.0f, 1e6f, 0.1f, 5.9604645e-8f};
  auto e = testing::encode(*c, x);
  // 1.0 = 0x3c00, -2 = 0xc000, 65504 = 0x7bff, 1e6 saturates to 0x7bff, 0.1 = 0x2e66,
  // 2^-24 = 0x0001 (smallest subnormal); little-endian.
  EXPECT_EQ(testing::payload_hex(e), "0000003c00c0ff7bff7b662e0100");
  EXPECT_EQ(e.bytes.size(), 24u + 2 * x.size());
}

TEST(Bf16, KnownVectorRoundsToNearestEven) {
  auto c = make_codec("bf16");
  // 1 + 2^-8 is a tie between 1.0 (even) and 1 + 2^-7: rounds to 1.0 = 0x3f80.
  // 1 + 3*2^-8 is a tie between 1+2^-7 (odd, 0x3f81) and 1+2^-6 (0x3f82): rounds to 0x3f82.
  std::vector<float> x = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -1.5f, 3.4e38f};
  auto e = testing::encode(*c, x);
  EXPECT_EQ(testing::payload_hex(e), "803f823fc0bf7f7f");
}

TEST(Half, RelativeErrorBound) {
  for (const char* spec : {"fp16", "bf16"}) {
    auto c = make_codec(spec);
    double eps = std::string(spec) == "fp16" ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
    auto x = testing::gradient(10001, 3, 1.0f);
    auto y = testing::round_trip(*c, x);
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (std::fabs(x[i]) < 6.2e-5f) continue;  // fp16 subnormals have absolute error
      ASSERT_LE(std::fabs(y[i] - x[i]), eps * std::fabs(x[i]) * 1.0000001) << spec << " " << i;
    }
  }
}

TEST(Half, CombineEqualsRoundedSum) {
  for (const char* spec : {"fp16", "bf16"}) {
    auto c = make_codec(spec);
    auto a = testing::gradient(5000, 1, 1.0f), b = testing::gradient(5000, 2, 1.0f);
    auto ea = testing::encode(*c, a), eb = testing::encode(*c, b);
    auto da = testing::decode(*c, ea.span(), a.size());
    auto db = testing::decode(*c, eb.span(), b.size());
    c->combine(ea.span(), eb.bytes);
    std::vector<float> sum(a.size());
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = da[i] + db[i];
    auto expect = testing::encode(*c, sum);
    EXPECT_EQ(eb.bytes, expect.bytes) << spec;
  }
}

TEST(Half, CompressionRatioIsTwo) {
  auto x = testing::gradient(1 << 20);
  for (const char* spec : {"fp16", "bf16"}) {
    auto c = make_codec(spec);
    EXPECT_EQ(testing::encode(*c, x).bytes.size(), 24u + 2 * x.size());
  }
}

}  // namespace
}  // namespace terse
