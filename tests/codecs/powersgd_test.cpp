// PowerSGD: exactness on low-rank matrices, warm-start convergence, the multi-rank round
// protocol simulated in process, error-feedback accounting, state round trips, shapes and
// hostile payloads.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "codec_testing.h"
#include "terse/codec.h"

namespace terse {
namespace {

using testing::decode;
using testing::encode;
using testing::gradient;
using testing::payload_hex;

constexpr std::size_t kStateHead = 4 + 8 + 8 + 8 + 4 + 4 + 8;  // see PowerSgdState::save

// A rows x cols matrix (row-major) of rank `rank`: a sum of random outer products.
std::vector<float> low_rank(std::size_t rows, std::size_t cols, std::size_t rank,
                            std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> m(rows * cols, 0.0f);
  for (std::size_t k = 0; k < rank; ++k) {
    std::vector<float> u(rows), v(cols);
    for (auto& a : u) a = normal(gen);
    for (auto& b : v) b = normal(gen);
    for (std::size_t i = 0; i < rows; ++i) {
      for (std::size_t j = 0; j < cols; ++j) m[i * cols + j] += u[i] * v[j];
    }
  }
  return m;
}

double rel_error(std::span<const float> a, std::span<const float> b) {
  double e = 0, s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    e += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    s += double(b[i]) * b[i];
  }
  return s == 0 ? std::sqrt(e) : std::sqrt(e / s);
}

std::vector<float> residual_of(const CodecState& st, std::size_t n) {
  std::vector<std::byte> bytes;
  st.save(bytes);
  std::vector<float> r(n);
  EXPECT_GE(bytes.size(), kStateHead + 4 * n);
  std::memcpy(r.data(), bytes.data() + kStateHead, 4 * n);
  return r;
}

void zero_residual(CodecState& st, std::size_t n) {
  std::vector<std::byte> bytes;
  st.save(bytes);
  std::memset(bytes.data() + kStateHead, 0, 4 * n);
  st.load(bytes);
}

// One step of the round protocol for N simulated ranks: contributions summed in rank order.
// Returns each rank's finish() output.
std::vector<std::vector<float>> run_ranks(const Codec& codec,
                                          std::vector<std::unique_ptr<CodecState>>& states,
                                          const std::vector<std::vector<float>>& xs,
                                          std::uint64_t step) {
  auto* rc = dynamic_cast<const RoundCodec*>(&codec);
  EXPECT_NE(rc, nullptr);
  std::size_t n = xs[0].size();
  std::vector<EncodeContext> ctx(xs.size());
  for (std::size_t w = 0; w < xs.size(); ++w) {
    ctx[w].seed = 77;
    ctx[w].step = step;
    ctx[w].tensor = 5;
    ctx[w].rank = w;
    ctx[w].state = states[w].get();
  }
  for (int r = 0; r < rc->rounds(); ++r) {
    std::size_t len = rc->round_elements(r, n);
    std::vector<float> sum(len, 0.0f), part(len);
    for (std::size_t w = 0; w < xs.size(); ++w) {
      rc->encode_round(r, xs[w], part, ctx[w]);
      for (std::size_t i = 0; i < len; ++i) sum[i] += part[i];
    }
    for (std::size_t w = 0; w < xs.size(); ++w) rc->absorb_round(r, sum, ctx[w]);
  }
  std::vector<std::vector<float>> ys(xs.size(), std::vector<float>(n));
  for (std::size_t w = 0; w < xs.size(); ++w) rc->finish(ys[w], ctx[w]);
  return ys;
}

TEST(PowerSgd, KnownVectors) {
  // 7 elements: prime, so raw fp32 (rows 1, cols 7, rank 0, scale 1.0).
  auto codec = make_codec("powersgd");
  std::vector<float> x = {1.0f, -2.0f, 0.5f, 0.0f, 3.0f, -0.25f, 8.0f};
  auto e = encode(*codec, x);
  EXPECT_EQ(payload_hex(e),
            "0100000000000000" "0700000000000000" "00000000" "0000803f"
            "0000803f" "000000c0" "0000003f" "00000000" "00004040" "000080be" "00000041");
  EXPECT_EQ(decode(*codec, e.span(), x.size()), x);
  // 64 elements: 8 x 8 at rank 1 (1 * 16 < 64 is compressed); values up to 50 give scale 32.
  auto y = gradient(64, 3);
  y[5] = 50.0f;
  auto c = encode(*make_codec("powersgd:rank=1"), y);
  EXPECT_EQ(payload_hex(c).substr(0, 48),
            "0800000000000000" "0800000000000000" "01000000" "00000042");
  EXPECT_EQ(c.bytes.size(), 24u + 24u + 4u * 16u);
}

TEST(PowerSgd, ReconstructsLowRankMatricesExactly) {
  for (std::size_t true_rank : {1, 2, 4}) {
    for (auto [rows, cols] : {std::pair<std::size_t, std::size_t>{48, 64}, {64, 48}, {33, 101}}) {
      auto x = low_rank(rows, cols, true_rank, rows + cols + true_rank);
      auto codec = make_codec(fmt::format("powersgd:rank=4,rows={}", rows));
      auto y = testing::round_trip(*codec, x);
      EXPECT_LT(rel_error(y, x), 2e-5) << rows << "x" << cols << " rank " << true_rank;
      // The round path on one rank gives the same approximation.
      std::vector<std::unique_ptr<CodecState>> states;
      states.push_back(codec->make_state(x.size()));
      auto ys = run_ranks(*codec, states, {x}, 0);
      EXPECT_LT(rel_error(ys[0], x), 2e-5);
    }
  }
}

TEST(PowerSgd, WarmStartConvergesOnAFixedMatrix) {
  // A full-rank matrix with a decaying spectrum: each step is one more power iteration, so the
  // rank-2 approximation improves. The residual is zeroed between steps to isolate the warm
  // start from error feedback.
  const std::size_t rows = 60, cols = 80, n = rows * cols;
  std::vector<float> x(n, 0.0f);
  for (std::size_t k = 0; k < 8; ++k) {
    auto part = low_rank(rows, cols, 1, 100 + k);
    float w = std::pow(0.75f, static_cast<float>(k));
    for (std::size_t i = 0; i < n; ++i) x[i] += w * part[i];
  }
  auto errors = [&](const std::string& spec) {
    auto codec = make_codec(spec);
    auto state = codec->make_state(n);
    EncodeContext ctx;
    ctx.seed = 3;
    ctx.state = state.get();
    std::vector<double> err;
    for (int step = 0; step < 12; ++step) {
      ctx.step = step;
      auto y = decode(*codec, testing::encode(*codec, x, ctx).span(), n);
      err.push_back(rel_error(y, x));
      zero_residual(*state, n);
    }
    return err;
  };
  auto warm = errors("powersgd:rank=2,rows=60");
  for (std::size_t i = 1; i < warm.size(); ++i) EXPECT_LE(warm[i], warm[i - 1] * 1.001) << i;
  EXPECT_LT(warm.back(), 0.9 * warm.front());
  auto cold = errors("powersgd:rank=2,rows=60,warm=0");
  double cold_best = *std::min_element(cold.begin(), cold.end());
  EXPECT_LT(warm.back(), cold_best);
}

TEST(PowerSgd, ThreeRanksAgreeAndApproximateTheSum) {
  const std::size_t rows = 40, cols = 70, n = rows * cols;
  auto codec = make_codec("powersgd:rank=4,rows=40");
  // (a) Inputs whose sum has rank 3 <= 4: the sum is reconstructed exactly.
  {
    std::vector<std::vector<float>> xs;
    for (int w = 0; w < 3; ++w) xs.push_back(low_rank(rows, cols, 1, 10 + w));
    std::vector<std::unique_ptr<CodecState>> states;
    for (int w = 0; w < 3; ++w) states.push_back(codec->make_state(n));
    auto ys = run_ranks(*codec, states, xs, 0);
    std::vector<float> sum(n, 0.0f);
    for (auto& x : xs) {
      for (std::size_t i = 0; i < n; ++i) sum[i] += x[i];
    }
    EXPECT_LT(rel_error(ys[0], sum), 3e-5);
    EXPECT_EQ(ys[0], ys[1]);
    EXPECT_EQ(ys[0], ys[2]);
  }
  // (b) Full-rank inputs over several steps: every rank's output is bit-identical, equals
  // (to rounding) a single rank compressing the sum, and error feedback accounts exactly:
  // sum_w (x_w + r_w) == y + sum_w r_w'.
  std::vector<std::unique_ptr<CodecState>> states, single;
  for (int w = 0; w < 3; ++w) states.push_back(codec->make_state(n));
  single.push_back(codec->make_state(n));
  std::vector<std::vector<float>> residuals(3, std::vector<float>(n, 0.0f));
  std::vector<float> single_res(n, 0.0f);
  for (int step = 0; step < 4; ++step) {
    std::vector<std::vector<float>> xs;
    for (int w = 0; w < 3; ++w) xs.push_back(gradient(n, 1000 + 10 * step + w));
    auto ys = run_ranks(*codec, states, xs, step);
    EXPECT_EQ(ys[0], ys[1]);
    EXPECT_EQ(ys[0], ys[2]);
    std::vector<float> total(n, 0.0f), accounted = ys[0];
    for (int w = 0; w < 3; ++w) {
      auto r_new = residual_of(*states[w], n);
      for (std::size_t i = 0; i < n; ++i) {
        total[i] += xs[w][i] + residuals[w][i];
        accounted[i] += r_new[i];
      }
      residuals[w] = r_new;
    }
    EXPECT_LT(rel_error(accounted, total), 1e-5) << "step " << step;
    // One rank fed the sum of the inputs and of the residuals follows the same trajectory:
    // PowerSGD only ever sees sum_w M_w.
    std::vector<float> summed(n, 0.0f);
    for (int w = 0; w < 3; ++w) {
      for (std::size_t i = 0; i < n; ++i) summed[i] += xs[w][i];
    }
    auto y1 = run_ranks(*codec, single, {summed}, step);
    EXPECT_LT(rel_error(y1[0], ys[0]), 1e-3) << "step " << step;
  }
}

TEST(PowerSgd, ErrorFeedbackAccountingSingleRank) {
  auto codec = make_codec("powersgd:rank=2");
  const std::size_t n = 1200;
  auto state = codec->make_state(n);
  EncodeContext ctx;
  ctx.state = state.get();
  std::vector<float> residual(n, 0.0f), sum_x(n, 0.0f), sum_y(n, 0.0f);
  for (int step = 0; step < 20; ++step) {
    ctx.step = step;
    auto x = gradient(n, 50 + step);
    auto y = decode(*codec, testing::encode(*codec, x, ctx).span(), n);
    auto r_new = residual_of(*state, n);
    for (std::size_t i = 0; i < n; ++i) {
      float t = x[i] + residual[i];
      ASSERT_NEAR(t, y[i] + r_new[i], 1e-5f * (std::fabs(t) + 1e-3f)) << step << " " << i;
      sum_x[i] += x[i];
      sum_y[i] += y[i];
    }
    residual = r_new;
  }
  // What was sent over 20 steps differs from what was given only by the last residual.
  std::vector<float> expect = sum_y;
  for (std::size_t i = 0; i < n; ++i) expect[i] += residual[i];
  EXPECT_LT(rel_error(expect, sum_x), 1e-4);
}

TEST(PowerSgd, AnotherRankAdoptsTheResidualAndRestartsTheWarmStart) {
  const std::size_t n = 1200;
  auto r1 = make_codec("powersgd:rank=1,rows=30");
  auto old_state = r1->make_state(n);
  EncodeContext ctx;
  ctx.state = old_state.get();
  testing::encode(*r1, gradient(n, 7), ctx);
  const auto residual = residual_of(*old_state, n);
  // The warm-start flag follows magic, n, rows, cols (u64 each) and the rank (u32).
  auto warm = [](const CodecState& s) {
    std::vector<std::byte> b;
    s.save(b);
    std::uint32_t flag;
    std::memcpy(&flag, b.data() + 4 + 3 * 8 + 4, 4);
    return flag;
  };
  ASSERT_EQ(warm(*old_state), 1u);

  // The same rank on another wire keeps Q; another rank keeps the residual and draws a new Q.
  auto fp16 = make_codec("powersgd:rank=1,rows=30,wire=fp16");
  auto same_shape = fp16->make_state(n);
  ASSERT_TRUE(same_shape->adopt(*old_state));
  EXPECT_EQ(residual_of(*same_shape, n), residual);
  EXPECT_EQ(warm(*same_shape), 1u);
  auto r4 = make_codec("powersgd:rank=4,rows=30");
  auto other_rank = r4->make_state(n);
  ASSERT_TRUE(other_rank->adopt(*same_shape));
  EXPECT_EQ(residual_of(*other_rank, n), residual);
  EXPECT_EQ(warm(*other_rank), 0u);
  EXPECT_FALSE(r4->make_state(n)->adopt(*r4->make_state(n - 30)));
}

TEST(PowerSgd, StateRestoreIsBitExactOnTheRoundPath) {
  auto codec = make_codec("powersgd:rank=3");
  const std::size_t n = 30 * 50;
  std::vector<std::unique_ptr<CodecState>> a;
  a.push_back(codec->make_state(n));
  for (int step = 0; step < 3; ++step) run_ranks(*codec, a, {gradient(n, step)}, step);
  std::vector<std::byte> saved;
  a[0]->save(saved);
  std::vector<std::unique_ptr<CodecState>> b;
  b.push_back(codec->make_state(n));
  b[0]->load(saved);
  for (int step = 3; step < 5; ++step) {
    auto x = gradient(n, step);
    EXPECT_EQ(run_ranks(*codec, a, {x}, step), run_ranks(*codec, b, {x}, step));
  }
  std::vector<std::byte> sa, sb;
  a[0]->save(sa);
  b[0]->load(sa);
  b[0]->save(sb);
  EXPECT_EQ(sa, sb);
  // Non-finite residuals and foreign states are refused, leaving the state as it was.
  auto bad = sa;
  float nan = NAN;
  std::memcpy(bad.data() + kStateHead, &nan, 4);
  EXPECT_THROW(b[0]->load(bad), DecodeError);
  bad = sa;
  bad[0] ^= std::byte{1};
  EXPECT_THROW(b[0]->load(bad), DecodeError);
  EXPECT_THROW(make_codec("powersgd:rank=2")->make_state(n)->load(sa), DecodeError);
  std::vector<std::byte> again;
  b[0]->save(again);
  EXPECT_EQ(again, sa);
}

TEST(PowerSgd, ShapesOddPrimeTinyAndThin) {
  auto codec = make_codec("powersgd");
  // Sizes that do not pay (prime, tiny, too thin for the rank) travel raw and exactly.
  for (std::size_t n : {0, 1, 2, 3, 4, 9, 16, 36, 97, 65537, 2 * 65537}) {
    auto x = gradient(n, n);
    auto e = encode(*codec, x);
    EXPECT_EQ(e.bytes.size(), 48 + 4 * n) << n;
    EXPECT_EQ(decode(*codec, e.span(), n), x) << n;
    std::vector<std::unique_ptr<CodecState>> st;
    st.push_back(codec->make_state(n));
    st.push_back(codec->make_state(n));
    if (n > 0) {
      auto twice = x;
      for (auto& v : twice) v *= 2;
      EXPECT_EQ(run_ranks(*codec, st, {x, x}, 0)[0], twice) << n;
    }
  }
  // Odd, non-square shapes compress: 33 x 35 at rank 4 sends 4 * 68 floats.
  auto odd = make_codec("powersgd:rows=33");
  auto x = gradient(33 * 35, 9);
  auto e = encode(*odd, x);
  EXPECT_EQ(e.bytes.size(), 48u + 4u * 4u * 68u);
  EXPECT_EQ(payload_hex(e).substr(0, 40), "2100000000000000" "2300000000000000" "04000000");
  // rank is clamped to min(rows, cols): a 2 x 1000 matrix at rank 8 sends raw.
  auto thin = make_codec("powersgd:rank=8,rows=2");
  EXPECT_EQ(encode(*thin, gradient(2000, 1)).bytes.size(), 48u + 4u * 2000u);
  // The automatic view is the most nearly square one.
  auto sq = encode(*codec, gradient(1000, 2));  // 25 x 40
  EXPECT_EQ(payload_hex(sq).substr(0, 40), "1900000000000000" "2800000000000000" "04000000");
  // Compression ratio of a 1024 x 1024 tensor at rank 4: n / (4 * 2048 + 6) ~ 128.
  auto big = encode(*codec, gradient(1024 * 1024, 3));
  EXPECT_EQ(big.bytes.size(), 48u + 4u * 4u * 2048u);
  // An explicit rows that does not divide the tensor is refused.
  EXPECT_THROW(odd->make_state(1000), InvalidArgument);
  std::vector<float> y(1000);
  EXPECT_THROW(odd->decode(e.span(), y), DecodeError);
}

TEST(PowerSgd, ZeroGradientsAndRecovery) {
  auto codec = make_codec("powersgd:rank=2");
  const std::size_t n = 40 * 40;
  auto state = codec->make_state(n);
  EncodeContext ctx;
  ctx.state = state.get();
  std::vector<float> zeros(n, 0.0f);
  for (int step = 0; step < 2; ++step) {
    ctx.step = step;
    auto y = decode(*codec, testing::encode(*codec, zeros, ctx).span(), n);
    for (float v : y) ASSERT_EQ(v, 0.0f);
  }
  // After zero steps the warm start was redrawn: a rank-2 matrix is still found at once.
  ctx.step = 2;
  auto x = low_rank(40, 40, 2, 8);
  auto y = decode(*codec, testing::encode(*codec, x, ctx).span(), n);
  EXPECT_LT(rel_error(y, x), 2e-5);
}

TEST(PowerSgd, RoundPathRejectsNaNAndMisuse) {
  auto codec = make_codec("powersgd");
  auto* rc = dynamic_cast<const RoundCodec*>(codec.get());
  ASSERT_NE(rc, nullptr);
  EXPECT_EQ(rc->rounds(), 2);
  EXPECT_TRUE(codec->traits().multi_round);
  EXPECT_TRUE(codec->traits().stateful);
  const std::size_t n = 1000;
  EXPECT_EQ(rc->round_elements(0, n), 4u * 25u);
  EXPECT_EQ(rc->round_elements(1, n), 4u * 40u);
  auto state = codec->make_state(n);
  EncodeContext ctx;
  ctx.state = state.get();
  // Give the state a non-zero residual first.
  std::vector<std::unique_ptr<CodecState>> holder;
  holder.push_back(std::move(state));
  run_ranks(*codec, holder, {gradient(n, 1)}, 0);
  ctx.state = holder[0].get();
  std::vector<std::byte> before;
  holder[0]->save(before);
  auto x = gradient(n, 2);
  x[123] = NAN;
  std::vector<float> p(rc->round_elements(0, n)), q(rc->round_elements(1, n)), y(n);
  try {
    rc->encode_round(0, x, p, ctx);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("element 123"), std::string::npos) << e.what();
  }
  std::vector<std::byte> after;
  holder[0]->save(after);
  EXPECT_EQ(before, after);
  // Out-of-order calls, wrong sizes, non-finite sums, a foreign state.
  EXPECT_THROW(rc->finish(y, ctx), InvalidArgument);
  EXPECT_THROW(rc->absorb_round(1, q, ctx), InvalidArgument);
  x[123] = 0.0f;
  rc->encode_round(0, x, p, ctx);
  std::vector<float> short_sum(p.size() - 1);
  EXPECT_THROW(rc->absorb_round(0, short_sum, ctx), InvalidArgument);
  auto bad_sum = p;
  bad_sum[3] = INFINITY;
  EXPECT_THROW(rc->absorb_round(0, bad_sum, ctx), InvalidArgument);
  EXPECT_THROW(rc->encode_round(1, x, q, ctx), InvalidArgument);
  rc->absorb_round(0, p, ctx);
  rc->encode_round(1, x, q, ctx);
  rc->absorb_round(1, q, ctx);
  rc->finish(y, ctx);
  EXPECT_THROW(rc->round_elements(2, n), InvalidArgument);
  EncodeContext none;
  EXPECT_THROW(rc->encode_round(0, x, p, none), InvalidArgument);
  auto other = codec->make_state(n + 1);
  none.state = other.get();
  EXPECT_THROW(rc->encode_round(0, x, p, none), InvalidArgument);
}

TEST(PowerSgd, RejectsHostilePayloads) {
  auto codec = make_codec("powersgd:rank=2,rows=20");
  const std::size_t n = 20 * 30;
  auto x = gradient(n, 4);
  x[0] = 100.0f;  // scale 64
  auto e = encode(*codec, x);
  std::vector<float> y(n);
  codec->decode(e.span(), y);
  auto put = [&](std::size_t at, auto v) {
    auto bad = e.bytes;
    std::memcpy(bad.data() + 24 + at, &v, sizeof(v));
    return bad;
  };
  const std::size_t p0 = 24, q0 = 24 + 4 * 2 * 20;
  for (auto bad : {put(0, std::uint64_t{30}), put(8, std::uint64_t{20}),
                   put(0, std::uint64_t{1} << 40), put(16, std::uint32_t{1}),
                   put(16, std::uint32_t{0}), put(16, std::uint32_t{0xffffffff}),
                   put(20, 3.0f), put(20, 0.5f), put(20, 0.0f), put(20, -64.0f), put(20, NAN),
                   put(20, INFINITY), put(p0, NAN), put(p0 + 8, 1.5f), put(p0 + 12, -INFINITY),
                   put(q0, NAN), put(q0 + 4, 1e6f), put(q0 + 4, INFINITY)}) {
    std::vector<float> out(n, 1.0f);
    EXPECT_THROW(codec->decode(bad, out), DecodeError);
  }
  // A raw payload with NaN inside.
  auto plain = make_codec("powersgd");
  auto raw = encode(*plain, gradient(7, 1));
  auto bad = raw.bytes;
  float nan = NAN;
  std::memcpy(bad.data() + 48 + 8, &nan, 4);
  std::vector<float> out(7);
  EXPECT_THROW(plain->decode(bad, out), DecodeError);
  bad = raw.bytes;
  float two = 2.0f;
  std::memcpy(bad.data() + 24 + 20, &two, 4);  // raw payloads carry scale 1
  EXPECT_THROW(plain->decode(bad, out), DecodeError);
  // Misaligned payload buffers decode the same.
  std::vector<std::byte> shifted(e.bytes.size() + 1);
  std::memcpy(shifted.data() + 1, e.bytes.data(), e.bytes.size());
  std::vector<float> z(n);
  codec->decode(std::span(shifted).subspan(1), z);
  EXPECT_EQ(y, z);
  // Largest decodable values stay finite: a huge scale saturates rather than overflowing.
  auto huge = gradient(n, 5);
  huge[7] = 3e38f;
  huge[8] = -3e38f;
  huge[37] = 3e38f;
  auto hy = testing::round_trip(*codec, huge);
  for (float v : hy) ASSERT_TRUE(std::isfinite(v));
}

TEST(PowerSgd, Parameters) {
  EXPECT_THROW(make_codec("powersgd:rank=0"), SpecError);
  EXPECT_THROW(make_codec("powersgd:rank=65"), SpecError);
  EXPECT_THROW(make_codec("powersgd:rows=-1"), SpecError);
  EXPECT_THROW(make_codec("powersgd:orth=qr"), SpecError);
  EXPECT_THROW(make_codec("powersgd:ef=1"), SpecError);
  EXPECT_THROW(make_codec("powersgd:ratio=0.1"), SpecError);
  EXPECT_THROW(make_codec("powersgd:wire=int8"), SpecError);
  EXPECT_EQ(make_codec("powersgd")->spec(),
            "powersgd:orth=gram-schmidt,rank=4,rows=0,warm=1,wire=fp32");
  EXPECT_NO_THROW(make_codec("powersgd:rank=64,rows=7,warm=0"));
  // Rank 64 on a 256 x 256 matrix reconstructs a rank-64 matrix.
  auto codec = make_codec("powersgd:rank=64");
  auto x = low_rank(256, 256, 64, 1);
  EXPECT_LT(rel_error(testing::round_trip(*codec, x), x), 1e-4);
}

TEST(PowerSgd, WireNamesTheCodecOfTheRoundSums) {
  auto exact = make_codec("powersgd");
  auto half = make_codec("powersgd:wire=fp16");
  const auto& exact_rounds = dynamic_cast<const RoundCodec&>(*exact);
  const auto& half_rounds = dynamic_cast<const RoundCodec&>(*half);
  EXPECT_EQ(exact_rounds.round_wire(0, 1 << 16), nullptr);
  ASSERT_NE(half_rounds.round_wire(0, 1 << 16), nullptr);
  EXPECT_EQ(half_rounds.round_wire(0, 1 << 16)->name(), "fp16");
  EXPECT_EQ(half_rounds.round_wire(1, 1 << 16)->name(), "fp16");
  EXPECT_TRUE(half_rounds.round_wire(1, 1 << 16)->traits().summable);
  auto brain = make_codec("powersgd:wire=bf16");
  EXPECT_EQ(dynamic_cast<const RoundCodec&>(*brain).round_wire(0, 1 << 16)->name(), "bf16");
  // A tensor too small to compress travels raw: exactly, in fp32.
  EXPECT_EQ(half_rounds.round_wire(0, 8), nullptr);
  // The digest covers the wire: ranks with different wires cannot exchange payloads.
  EXPECT_NE(exact->spec(), half->spec());
}

}  // namespace
}  // namespace terse
