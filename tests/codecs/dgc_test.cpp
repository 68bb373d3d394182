#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "codec_testing.h"
#include "sparse_testing.h"

namespace terse {
namespace {

using testing::parse_sparse;
using testing::SparseList;

// DGC as the paper writes it, one element at a time: u = m u + g, v = v + u; send the k largest
// |v| (the exact threshold: small tensors are not sampled), then zero u and v where sent.
struct Reference {
  float m;
  std::size_t k;
  std::vector<float> u, v;

  SparseList step(const std::vector<float>& g) {
    for (std::size_t i = 0; i < g.size(); ++i) {
      float mu = m * u[i];
      u[i] = std::clamp(mu + g[i], -FLT_MAX, FLT_MAX);
      v[i] = std::clamp(v[i] + u[i], -FLT_MAX, FLT_MAX);
    }
    std::vector<float> mag(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) mag[i] = std::fabs(v[i]);
    std::nth_element(mag.begin(), mag.begin() + (k - 1), mag.end(), std::greater<>());
    const float threshold = mag[k - 1];
    SparseList sent;
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (std::fabs(v[i]) >= threshold && v[i] != 0.0f) {
        sent.idx.push_back(static_cast<std::uint32_t>(i));
        sent.val.push_back(v[i]);
        u[i] = v[i] = 0.0f;
      }
    }
    return sent;
  }
};

// The state's bytes: "TSDG", n, u, v.
std::pair<std::vector<float>, std::vector<float>> state_of(const CodecState& s, std::size_t n) {
  std::vector<std::byte> b;
  s.save(b);
  EXPECT_EQ(b.size(), 12 + 8 * n);
  std::vector<float> u(n), v(n);
  std::memcpy(u.data(), b.data() + 12, 4 * n);
  std::memcpy(v.data(), b.data() + 12 + 4 * n, 4 * n);
  return {u, v};
}

TEST(Dgc, KnownVector) {
  auto c = make_codec("dgc:ratio=0.25");
  std::vector<float> g = {0.5f, -3.0f, 0.0f, 2.0f, -2.0f, 1.0f, 4.0f, -0.25f};
  auto state = c->make_state(g.size());
  EncodeContext ctx;
  ctx.state = state.get();
  // Step 0 from zero state: v = g, k = 2: |v| 4 and 3 at indices 1 and 6.
  EXPECT_EQ(testing::payload_hex(testing::encode(*c, g, ctx)),
            "02000000" "01000000" "06000000" "000040c0" "00008040");
  // Step 1: u = 0.9 u + g (0 where sent), v += u; 2 + (1.8 + 2) = 5.8 ties with -5.8.
  auto e = testing::encode(*c, g, ctx);
  const float u3 = 0.9f * 2.0f + 2.0f;
  EXPECT_EQ(parse_sparse(e).idx, (std::vector<std::uint32_t>{3, 4}));
  EXPECT_EQ(parse_sparse(e).val, (std::vector<float>{2.0f + u3, -(2.0f + u3)}));
}

TEST(Dgc, MatchesTheScalarReferenceStepByStep) {
  for (std::size_t n : {1, 7, 16, 100, 1000, 8000}) {
    for (float m : {0.0f, 0.9f}) {
      auto c = make_codec(fmt::format("dgc:ratio=0.01,momentum={}", m));
      auto state = c->make_state(n);
      EncodeContext ctx;
      ctx.state = state.get();
      Reference ref{m, std::max<std::size_t>(1, std::llround(0.01 * n)),
                    std::vector<float>(n), std::vector<float>(n)};
      for (int step = 0; step < 6; ++step) {
        auto g = testing::gradient(n, 100 * n + step);
        ctx.step = step;
        auto e = testing::encode(*c, g, ctx);
        auto expect = ref.step(g);
        auto got = parse_sparse(e);
        ASSERT_EQ(got.idx, expect.idx) << "n=" << n << " m=" << m << " step " << step;
        ASSERT_EQ(got.val, expect.val) << "n=" << n << " m=" << m << " step " << step;
        auto [u, v] = state_of(*state, n);
        ASSERT_EQ(u, ref.u);
        ASSERT_EQ(v, ref.v);
        testing::expect_sparse_decode(*c, e, n);
      }
    }
  }
}

TEST(Dgc, MomentumCorrectionAndFactorMasking) {
  // k = 1 of 2, constant gradients 1 and 0.6. Step 0 sends x0 = 1 and zeroes its u and v.
  // Step 1: x1 has accumulated velocity 0.6 + (0.9 * 0.6 + 0.6) = 1.74 and goes, while x0's
  // momentum restarted from zero (u0 = 1, v0 = 1). Step 2: x0 has 1 + (0.9 + 1) = 2.9.
  auto c = make_codec("dgc:ratio=0.5");
  std::vector<float> g = {1.0f, 0.6f};
  auto state = c->make_state(2);
  EncodeContext ctx;
  ctx.state = state.get();
  auto y0 = testing::decode(*c, testing::encode(*c, g, ctx).span(), 2);
  auto y1 = testing::decode(*c, testing::encode(*c, g, ctx).span(), 2);
  auto y2 = testing::decode(*c, testing::encode(*c, g, ctx).span(), 2);
  const float u1 = 0.9f * 0.6f + 0.6f, u0 = 0.9f * 1.0f + 1.0f;
  EXPECT_EQ(y0, (std::vector<float>{1.0f, 0.0f}));
  EXPECT_EQ(y1, (std::vector<float>{0.0f, 0.6f + u1}));
  EXPECT_EQ(y2, (std::vector<float>{1.0f + u0, 0.0f}));
  auto [u, v] = state_of(*state, 2);
  EXPECT_EQ(u, (std::vector<float>{0.0f, 0.6f}));  // x1 restarted at step 2
  EXPECT_EQ(v, (std::vector<float>{0.0f, 0.6f}));
}

TEST(Dgc, SampledThresholdSeparatesSentFromKept) {
  const std::size_t n = 1 << 20, k = 1049;  // round(0.001 n); sample 1%: not exact
  auto c = make_codec("dgc");
  auto state = c->make_state(n);
  EncodeContext ctx;
  ctx.seed = 3;
  ctx.state = state.get();
  for (int step = 0; step < 4; ++step) {
    ctx.step = step;
    auto e = testing::encode(*c, testing::gradient(n, 50 + step), ctx);
    auto s = parse_sparse(e);
    EXPECT_GE(s.idx.size(), k / 2) << step;
    EXPECT_LE(s.idx.size(), 2 * k) << step;
    float smallest_sent = FLT_MAX, largest_kept = 0;
    for (float v : s.val) smallest_sent = std::min(smallest_sent, std::fabs(v));
    for (float v : state_of(*state, n).second) largest_kept = std::max(largest_kept, std::fabs(v));
    EXPECT_GE(smallest_sent, largest_kept) << step;
  }
}

TEST(Dgc, NeverSendsMoreThanTwiceTheTarget) {
  // Equal values fool any threshold: everything qualifies. The lists are cut to the k largest
  // (ties to the lowest indices) and the rest stays in the accumulators.
  for (std::size_t n : {1000, 100'000}) {
    auto c = make_codec("dgc:ratio=0.01");
    auto state = c->make_state(n);
    EncodeContext ctx;
    ctx.state = state.get();
    std::vector<float> g(n, -0.5f);
    auto s = parse_sparse(testing::encode(*c, g, ctx));
    const std::size_t k = n / 100;
    ASSERT_EQ(s.idx.size(), k);
    for (std::size_t t = 0; t < k; ++t) ASSERT_EQ(s.idx[t], t);
    auto [u, v] = state_of(*state, n);
    EXPECT_EQ(v[k - 1], 0.0f);
    EXPECT_EQ(v[k], -0.5f);
    EXPECT_EQ(u[k], -0.5f);
  }
}

TEST(Dgc, SavedStateReproducesTheNextEncodingOnTheSampledPath) {
  const std::size_t n = 200'000;
  auto c = make_codec("dgc:ratio=0.002");
  auto a = c->make_state(n);
  EncodeContext ctx;
  ctx.state = a.get();
  for (int step = 0; step < 3; ++step) {
    ctx.step = step;
    testing::encode(*c, testing::gradient(n, step), ctx);
  }
  std::vector<std::byte> saved;
  a->save(saved);
  auto b = c->make_state(n);
  b->load(saved);
  ctx.step = 3;
  auto x = testing::gradient(n, 9);
  auto ea = testing::encode(*c, x, ctx);
  ctx.state = b.get();
  auto eb = testing::encode(*c, x, ctx);
  EXPECT_EQ(ea.bytes, eb.bytes);
  std::vector<std::byte> sa, sb;
  a->save(sa);
  b->save(sb);
  EXPECT_EQ(sa, sb);
  // A state holding NaN is refused.
  float nan = NAN;
  std::memcpy(saved.data() + 12 + 40, &nan, 4);
  EXPECT_THROW(b->load(saved), DecodeError);
}

TEST(Dgc, AStateAtAnotherRatioAdoptsMomentumAndVelocity) {
  auto before = make_codec("dgc:ratio=0.25");
  auto after = make_codec("dgc:ratio=0.5,momentum=0.5");
  std::vector<float> g = {0.5f, -3.0f, 0.0f, 2.0f, -2.0f, 1.0f, 4.0f, -0.25f};
  auto old_state = before->make_state(g.size());
  EncodeContext ctx;
  ctx.state = old_state.get();
  testing::encode(*before, g, ctx);
  const auto kept = state_of(*old_state, g.size());
  EXPECT_NE(kept.second, std::vector<float>(g.size(), 0.0f));
  auto new_state = after->make_state(g.size());
  ASSERT_TRUE(new_state->adopt(*old_state));
  EXPECT_EQ(state_of(*new_state, g.size()), kept);
  EXPECT_FALSE(after->make_state(4)->adopt(*before->make_state(8)));
}

TEST(Dgc, CompressionRatio) {
  const std::size_t n = 1 << 20;
  auto c = make_codec("dgc");
  EXPECT_EQ(c->max_encoded_bytes(n), 24u + 4 + 8 * 2098);  // at most 2k = 2 round(0.001 n)
  auto e = testing::encode(*c, testing::gradient(n, 1));
  EXPECT_EQ(e.bytes.size(), 24 + 4 + 8 * parse_sparse(e).idx.size());
  EXPECT_GT(4.0 * n / e.bytes.size(), 250.0);  // ~500x at the target density
}

TEST(Dgc, EdgeCases) {
  auto c = make_codec("dgc");
  EXPECT_EQ(testing::payload_hex(testing::encode(*c, std::vector<float>{})), "00000000");
  EXPECT_EQ(testing::payload_hex(testing::encode(*c, std::vector<float>(5000, 0.0f))),
            "00000000");  // zeros are never sent
  std::vector<float> one = {-2.0f};
  EXPECT_EQ(testing::round_trip(*c, one), one);
  std::vector<float> huge = {3.4e38f, 3.4e38f};
  auto state = c->make_state(2);
  EncodeContext ctx;
  ctx.state = state.get();
  for (int step = 0; step < 3; ++step) {  // accumulates past FLT_MAX: saturates, stays finite
    for (float v : testing::decode(*c, testing::encode(*c, huge, ctx).span(), 2)) {
      EXPECT_TRUE(std::isfinite(v));
    }
  }
}

TEST(Dgc, RejectsCorruptPayloads) {
  auto c = make_codec("dgc:ratio=0.02");
  auto x = testing::gradient(400, 3);
  auto e = testing::encode(*c, x);
  testing::expect_rejects_sparse_corruptions(*c, e, x.size());
  auto s = parse_sparse(e);
  s.val[0] = 0.0f;  // zeros are never sent
  std::vector<float> y(x.size());
  EXPECT_THROW(c->decode(testing::build_sparse(e, s).span(), y), DecodeError);
}

TEST(Dgc, ParametersAndErrorFeedback) {
  for (const char* bad : {"dgc:ratio=0", "dgc:ratio=2", "dgc:sample=0", "dgc:sample=1.5",
                          "dgc:momentum=1", "dgc:momentum=-0.1", "dgc:clip=1"}) {
    EXPECT_THROW(make_codec(bad), SpecError) << bad;
  }
  // The accumulation is error feedback already: ef=1 would feed the unsent mass back twice.
  EXPECT_THROW(make_codec("dgc:ef=1"), SpecError);
  EXPECT_EQ(make_codec("dgc")->spec(), "dgc:momentum=0.9,ratio=0.001,sample=0.01");
  auto t = make_codec("dgc")->traits();
  EXPECT_TRUE(t.stateful && t.builtin_feedback && t.sparse && !t.summable);
}

}  // namespace
}  // namespace terse
