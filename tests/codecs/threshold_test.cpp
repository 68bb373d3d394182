#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "codec_testing.h"
#include "sparse_testing.h"

namespace terse {
namespace {

using testing::parse_sparse;

TEST(Threshold, KnownVector) {
  auto c = make_codec("threshold:tau=1,max_ratio=1");  // the default cap would keep 1 of 8
  std::vector<float> x = {0.5f, -3.0f, 1.0f, 2.0f, -1.0000001f, 0.0f, -1.0f, 1.5f};
  auto e = testing::encode(*c, x);
  // |x| > 1 strictly: indices 1, 3, 4, 7 (exactly 1 stays home).
  EXPECT_EQ(testing::payload_hex(e),
            "04000000" "01000000" "03000000" "04000000" "07000000"
            "000040c0" "00000040" "010080bf" "0000c03f");
  EXPECT_EQ(testing::decode(*c, e.span(), x.size()),
            (std::vector<float>{0, -3, 0, 2, -1.0000001f, 0, 0, 1.5f}));
}

TEST(Threshold, KeepsExactlyTheMagnitudesAboveTau) {
  for (std::size_t n : {1, 15, 16, 17, 1000, 100'003}) {
    auto x = testing::gradient(n, n);
    for (float tau : {0.0f, 0.005f, 0.02f}) {
      auto c = make_codec(fmt::format("threshold:tau={},max_ratio=1", tau));
      auto y = testing::round_trip(*c, x);
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(y[i], std::fabs(x[i]) > tau ? x[i] : 0.0f) << "tau=" << tau << " i=" << i;
      }
      testing::expect_sparse_decode(*c, testing::encode(*c, x), n);
    }
  }
}

TEST(Threshold, CapSendsTheLargestWhenTooManyExceedTau) {
  // sigma 0.01 and tau 0.001: ~92% exceed tau; the cap of 5% keeps the 5% largest, which is
  // exactly what top-k sends.
  for (std::size_t n : {1000, 200'003}) {
    auto x = testing::gradient(n, 7);
    auto t = make_codec("threshold:max_ratio=0.05");
    auto e = testing::encode(*t, x);
    EXPECT_EQ(parse_sparse(e).idx.size(), static_cast<std::size_t>(std::llround(0.05 * n)));
    EXPECT_EQ(e.bytes.size(), t->max_encoded_bytes(n));
    EXPECT_EQ(testing::decode(*t, e.span(), n),
              testing::round_trip(*make_codec("topk:ratio=0.05"), x));
  }
}

TEST(Threshold, CompressionRatioFollowsTheCount) {
  auto x = testing::gradient(1 << 20, 2);
  auto c = make_codec("threshold:tau=0.03");  // 3 sigma: 0.27% of normals, most outliers
  auto e = testing::encode(*c, x);
  std::size_t count = 0;
  for (float v : x) count += std::fabs(v) > 0.03f;
  EXPECT_EQ(parse_sparse(e).idx.size(), count);
  EXPECT_EQ(e.bytes.size(), 24 + 4 + 8 * count);
  EXPECT_GT(4.0 * x.size() / e.bytes.size(), 35.0);  // 1.2% sent, 8 bytes each
  // The bound never exceeded: max_ratio * n entries.
  EXPECT_EQ(c->max_encoded_bytes(x.size()), 24u + 4 + 8 * 104858);  // round(0.1 * 2^20)
}

TEST(Threshold, EdgeCases) {
  auto c = make_codec("threshold");
  EXPECT_EQ(testing::payload_hex(testing::encode(*c, std::vector<float>{})), "00000000");
  EXPECT_EQ(testing::payload_hex(testing::encode(*c, std::vector<float>(100, 0.0f))), "00000000");
  std::vector<float> one = {-2.0f};
  EXPECT_EQ(testing::round_trip(*c, one), one);
  std::vector<float> huge = {3.4e38f, -3.4e38f, 0.0f};
  EXPECT_EQ(testing::round_trip(*make_codec("threshold:max_ratio=1"), huge), huge);
  auto big_tau = make_codec("threshold:tau=3.4028234663852886e38");
  EXPECT_EQ(parse_sparse(testing::encode(*big_tau, huge)).idx.size(), 0u);
}

TEST(Threshold, RejectsCorruptPayloads) {
  auto c = make_codec("threshold:tau=0.01");
  auto x = testing::gradient(400, 3);
  auto e = testing::encode(*c, x);
  testing::expect_rejects_sparse_corruptions(*c, e, x.size());
  // A value at or below tau is something the encoder never sends.
  for (float bad : {0.01f, -0.01f, 0.0f, 0.001f}) {
    auto s = parse_sparse(e);
    s.val[1] = bad;
    std::vector<float> y(x.size());
    EXPECT_THROW(c->decode(testing::build_sparse(e, s).span(), y), DecodeError) << bad;
  }
  auto fewer = parse_sparse(e);  // fewer entries are fine: any count up to the cap
  fewer.idx.resize(1);
  fewer.val.resize(1);
  std::vector<float> y(x.size());
  EXPECT_NO_THROW(c->decode(testing::build_sparse(e, fewer).span(), y));
}

TEST(Threshold, RejectsInvalidParameters) {
  for (const char* bad : {"threshold:tau=-1", "threshold:tau=1e39", "threshold:max_ratio=0",
                          "threshold:max_ratio=2", "threshold:ratio=0.1"}) {
    EXPECT_THROW(make_codec(bad), SpecError) << bad;
  }
  EXPECT_EQ(make_codec("threshold")->spec(), "threshold:max_ratio=0.1,tau=0.001");
}

}  // namespace
}  // namespace terse
