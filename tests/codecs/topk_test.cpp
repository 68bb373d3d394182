#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "codec_testing.h"
#include "sparse_testing.h"

namespace terse {
namespace {

using testing::parse_sparse;

TEST(TopK, KnownVector) {
  auto c = make_codec("topk:ratio=0.5");
  std::vector<float> x = {0.5f, -3.0f, 0.0f, 2.0f, -2.0f, 1.0f, 4.0f, -0.25f};
  auto e = testing::encode(*c, x);
  // k = 4: |x| 4, 3, 2, 2 at indices 1, 3, 4, 6; values -3, 2, -2, 4.
  EXPECT_EQ(testing::payload_hex(e),
            "04000000" "01000000" "03000000" "04000000" "06000000"
            "000040c0" "00000040" "000000c0" "00008040");
  auto y = testing::decode(*c, e.span(), x.size());
  EXPECT_EQ(y, (std::vector<float>{0, -3, 0, 2, -2, 0, 4, 0}));
  // Ties go to the lower index.
  std::vector<float> t = {1.0f, -1.0f, 1.0f, 2.0f};
  EXPECT_EQ(testing::payload_hex(testing::encode(*c, t)),
            "02000000" "00000000" "03000000" "0000803f" "00000040");
}

// The k largest |x| with ties to the lower index, the rest zero.
void expect_top_k(const std::string& spec, const std::vector<float>& x, std::size_t k) {
  auto c = make_codec(spec);
  auto e = testing::encode(*c, x);
  ASSERT_EQ(parse_sparse(e).idx.size(), k) << spec;
  std::vector<std::size_t> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](auto a, auto b) { return std::fabs(x[a]) > std::fabs(x[b]); });
  std::vector<float> expect(x.size(), 0.0f);
  for (std::size_t t = 0; t < k; ++t) expect[order[t]] = x[order[t]];
  EXPECT_EQ(testing::decode(*c, e.span(), x.size()), expect) << spec << " n=" << x.size();
  testing::expect_sparse_decode(*c, e, x.size());
}

TEST(TopK, SendsExactlyTheKLargestMagnitudes) {
  for (std::size_t n : {1, 2, 3, 16, 17, 99, 1000, 4097, 200'003}) {
    auto x = testing::gradient(n, n);
    expect_top_k("topk", x, std::max<std::size_t>(1, std::llround(0.01 * n)));
    expect_top_k("topk:ratio=0.3", x, std::max<std::size_t>(1, std::llround(0.3 * n)));
  }
  // Many equal magnitudes and zeros: ties resolved by index.
  std::vector<float> x(300'000, 0.0f);
  for (std::size_t i = 0; i < x.size(); i += 7) x[i] = (i % 3 == 0) ? -1.0f : 1.0f;
  expect_top_k("topk:ratio=0.1", x, 30'000);
  expect_top_k("topk:ratio=0.2", x, 60'000);  // more than the nonzeros: zeros from the front
}

TEST(TopK, KRoundsToNearestAtLeastOneAtMostN) {
  auto x = testing::gradient(10, 1);
  EXPECT_EQ(parse_sparse(testing::encode(*make_codec("topk"), x)).idx.size(), 1u);  // 0.1 -> 1
  EXPECT_EQ(parse_sparse(testing::encode(*make_codec("topk:ratio=0.25"), x)).idx.size(),
            3u);  // 2.5 rounds away from zero
  auto c = make_codec("topk:ratio=1");  // k = n: lossless
  EXPECT_EQ(testing::round_trip(*c, x), x);
  std::vector<float> one = {-7.5f};
  EXPECT_EQ(testing::round_trip(*make_codec("topk"), one), one);
  auto empty = testing::encode(*make_codec("topk"), std::vector<float>{});
  EXPECT_EQ(testing::payload_hex(empty), "00000000");
}

TEST(TopK, CompressionRatio) {
  auto x = testing::gradient(1 << 20);
  const std::size_t k = 10486;  // round(0.01 * 2^20)
  auto e = testing::encode(*make_codec("topk"), x);
  EXPECT_EQ(e.bytes.size(), 24u + 4 + 8 * k);
  EXPECT_GT(4.0 * x.size() / e.bytes.size(), 49.9);
  EXPECT_EQ(make_codec("topk")->max_encoded_bytes(x.size()), e.bytes.size());
}

TEST(TopK, HugeValuesAndAllZeros) {
  std::vector<float> x(1000, 1e-3f);
  x[10] = 3.4e38f;
  x[20] = -3.4e38f;
  auto y = testing::round_trip(*make_codec("topk:ratio=0.002"), x);
  EXPECT_EQ(y[10], 3.4e38f);
  EXPECT_EQ(y[20], -3.4e38f);
  std::vector<float> zeros(1000, 0.0f);
  auto e = testing::encode(*make_codec("topk"), zeros);
  EXPECT_EQ(parse_sparse(e).idx, (std::vector<std::uint32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

TEST(TopK, RejectsCorruptPayloads) {
  auto c = make_codec("topk:ratio=0.05");
  auto x = testing::gradient(400, 3);
  auto e = testing::encode(*c, x);
  testing::expect_rejects_sparse_corruptions(*c, e, x.size());
  auto s = parse_sparse(e);  // one entry fewer, consistently: topk always sends exactly k
  s.idx.pop_back();
  s.val.pop_back();
  std::vector<float> y(x.size());
  EXPECT_THROW(c->decode(testing::build_sparse(e, s).span(), y), DecodeError);
}

TEST(TopK, ErrorFeedbackSendsEverythingEventually) {
  // With ef=1 the unsent mass waits in the residual: over many steps of the same gradient the
  // decoded sum approaches steps * x, everywhere.
  auto c = make_codec("topk:ratio=0.1,ef=1");
  auto x = testing::gradient(200, 4);
  auto state = c->make_state(x.size());
  EncodeContext ctx;
  ctx.state = state.get();
  std::vector<double> sum(x.size());
  const int steps = 200;
  for (int s = 0; s < steps; ++s) {
    auto y = testing::decode(*c, testing::encode(*c, x, ctx).span(), x.size());
    for (std::size_t i = 0; i < x.size(); ++i) sum[i] += y[i];
  }
  for (std::size_t i = 0; i < x.size(); ++i) {
    EXPECT_NEAR(sum[i] / steps, x[i], 0.05 * std::fabs(x[i]) + 1e-3) << i;
  }
}

TEST(TopK, ErrorFeedbackAtAnotherRatioAdoptsTheResidual) {
  // One step at 10% leaves x - y0 in the residual; a state at 50% that adopts it sends the
  // top half of that residual for a zero gradient, exactly what plain top-k 50% makes of it.
  auto before = make_codec("topk:ratio=0.1,ef=1");
  auto after = make_codec("topk:ratio=0.5,ef=1");
  auto x = testing::gradient(200, 5);
  auto old_state = before->make_state(x.size());
  EncodeContext ctx;
  ctx.state = old_state.get();
  auto y0 = testing::decode(*before, testing::encode(*before, x, ctx).span(), x.size());
  std::vector<float> residual(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) residual[i] = x[i] - y0[i];

  auto new_state = after->make_state(x.size());
  ASSERT_TRUE(new_state->adopt(*old_state));
  ctx.state = new_state.get();
  const std::vector<float> zeros(x.size(), 0.0f);
  auto y1 = testing::decode(*after, testing::encode(*after, zeros, ctx).span(), x.size());
  auto plain = make_codec("topk:ratio=0.5");
  EncodeContext none;
  EXPECT_EQ(y1, testing::decode(*plain, testing::encode(*plain, residual, none).span(),
                                x.size()));
  // Nothing to take from another kind of state or another size.
  auto dgc = make_codec("dgc");
  EXPECT_FALSE(after->make_state(x.size())->adopt(*dgc->make_state(x.size())));
  EXPECT_FALSE(after->make_state(x.size())->adopt(*before->make_state(x.size() + 1)));
}

TEST(TopK, RejectsInvalidParameters) {
  for (const char* bad : {"topk:ratio=0", "topk:ratio=-0.1", "topk:ratio=1.5", "topk:ratio=x",
                          "topk:k=5"}) {
    EXPECT_THROW(make_codec(bad), SpecError) << bad;
  }
  EXPECT_EQ(make_codec("topk")->spec(), "topk:ratio=0.01");
}

}  // namespace
}  // namespace terse
