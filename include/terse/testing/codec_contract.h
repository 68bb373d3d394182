// The contract every codec keeps, as a GoogleTest suite for any registered codec, in terse's
// tree (tests/codecs/contract_test.cpp runs it for every built-in codec) or outside it against
// an installed terse. Include this header in exactly one file of a test binary (it defines the
// tests), link GTest, and instantiate the suite with the specs to check and their error bounds:
//
//   INSTANTIATE_TEST_SUITE_P(Mine, CodecContract,
//                            ::testing::Values(terse::testing::ContractCase{"mine", bound},
//                                              terse::testing::ContractCase{"mine:ef=1", bound}),
//                            terse::testing::contract_case_name);
//
// What it checks: round trips of every size within the codec's stated error bound (exact for
// lossless codecs); zeros, huge values and half-precision input; the non-finite policy; decode's
// accumulate mode; that truncated, oversized, foreign and randomly corrupted payloads are
// refused with DecodeError or decode to finite values inside the destination; state save and
// load; and error feedback's bookkeeping.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "terse/codec.h"
#include "terse/codec_kit.h"
#include "terse/dtype.h"
#include "terse/error.h"
#include "terse/testing/codec_testing.h"

namespace terse::testing {

// The largest error decode(encode(x)) = y may have for input x, from the codec's definition, at
// the parameters of the spec it comes with (and for the first step of a stateful codec, from a
// fresh state). Either part may be empty; a lossy codec needs at least one.
struct ErrorBound {
  // ||y - x||_2 <= l2(x)
  std::function<double(std::span<const float> x)> l2;
  // |y_i - x_i| <= per_element(x)[i] for every i
  std::function<std::vector<double>(std::span<const float> x)> per_element;
};

struct ContractCase {
  std::string spec;
  ErrorBound bound;  // unused for lossless codecs, which must give x back bit for bit
};

// Test names from specs: every character other than a letter or digit becomes '_'.
inline std::string contract_case_name(const ::testing::TestParamInfo<ContractCase>& info) {
  std::string s = info.param.spec;
  for (auto& c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return s;
}
inline void PrintTo(const ContractCase& c, std::ostream* os) { *os << c.spec; }

// Checks y against c's bound for x (or exactness for a lossless codec). Bounds are computed
// in double and allowed a relative 1e-5 for the rounding of the codec's fp32 arithmetic.
inline void expect_within_bound(const Codec& codec, const ContractCase& c, std::span<const float> x,
                                std::span<const float> y, const std::string& where) {
  ASSERT_EQ(x.size(), y.size()) << where;
  for (std::size_t i = 0; i < y.size(); ++i) {
    ASSERT_TRUE(std::isfinite(y[i])) << where << " i=" << i;
  }
  if (codec.traits().lossless) {
    for (std::size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], y[i]) << where << " i=" << i;
    return;
  }
  ASSERT_TRUE(c.bound.l2 || c.bound.per_element)
      << c.spec << " is lossy and its ContractCase states no error bound";
  constexpr double kSlack = 1e-5;
  if (c.bound.per_element) {
    const std::vector<double> b = c.bound.per_element(x);
    ASSERT_EQ(b.size(), x.size()) << where;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double err = std::fabs(static_cast<double>(y[i]) - x[i]);
      ASSERT_LE(err, b[i] * (1 + kSlack) + 1e-37)
          << where << " i=" << i << " x=" << x[i] << " y=" << y[i];
    }
  }
  if (c.bound.l2) {
    double err = 0, norm = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double d = static_cast<double>(y[i]) - x[i];
      err += d * d;
      norm += static_cast<double>(x[i]) * x[i];
    }
    EXPECT_LE(std::sqrt(err), c.bound.l2(x) + kSlack * std::sqrt(norm) + 1e-37) << where;
  }
}

class CodecContract : public ::testing::TestWithParam<ContractCase> {
 protected:
  std::unique_ptr<Codec> codec = make_codec(GetParam().spec);
};

TEST_P(CodecContract, RoundTripsEverySizeWithinItsErrorBound) {
  for (std::size_t n :
       {0, 1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 1000, 4097, 65537}) {
    auto x = gradient(n, n + 1);
    auto e = encode(*codec, x);
    EXPECT_LE(e.bytes.size(), codec->max_encoded_bytes(n)) << "n=" << n;
    auto y = decode(*codec, e.span(), n);
    expect_within_bound(*codec, GetParam(), x, y, "n=" + std::to_string(n));
  }
}

TEST_P(CodecContract, AllZerosStayZero) {
  std::vector<float> x(1001, 0.0f);
  auto y = decode(*codec, encode(*codec, x).span(), x.size());
  for (float v : y) ASSERT_EQ(v, 0.0f);
}

TEST_P(CodecContract, HugeValuesStayFinite) {
  auto x = gradient(513, 3);
  x[7] = 3e38f;
  x[100] = -3e38f;
  x[200] = 1e30f;
  auto y = decode(*codec, encode(*codec, x).span(), x.size());
  for (float v : y) ASSERT_TRUE(std::isfinite(v));
}

TEST_P(CodecContract, RejectsNaNAndInfNamingTheIndex) {
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    for (std::size_t at : {0, 5, 16, 999}) {
      auto x = gradient(1000, 5);
      x[at] = bad;
      auto state = codec->make_state(x.size());
      std::vector<std::byte> before;
      if (state) state->save(before);
      EncodeContext ctx;
      ctx.state = state.get();
      std::vector<std::byte> out(codec->max_encoded_bytes(x.size()));
      try {
        codec->encode(x, out, ctx);
        FAIL() << "accepted " << bad << " at " << at;
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("element " + std::to_string(at)), std::string::npos)
            << e.what();
      }
      if (state) {  // a rejected input loses nothing
        std::vector<std::byte> after;
        state->save(after);
        EXPECT_EQ(before, after);
      }
    }
  }
}

// Half-precision input: 16-bit values of x, and their exact fp32 widening.
struct HalfInput {
  std::vector<std::uint16_t> bits;
  std::vector<float> wide;
};
inline HalfInput to_half(DType dtype, std::span<const float> x) {
  HalfInput h{std::vector<std::uint16_t>(x.size()), std::vector<float>(x.size())};
  EXPECT_TRUE(codec_kit::narrow(dtype, x, h.bits.data()));
  EXPECT_TRUE(codec_kit::widen(dtype, h.bits.data(), h.wide, false));
  return h;
}

// Encoding fp16 or bf16 values gives the bytes of encoding their fp32 widening, step after step
// with the same state (error-feedback residuals stay fp32), so every strategy's results on half
// tensors are the fp32 path's on the rounded values, and decoding keeps the fp32 path's bound.
TEST_P(CodecContract, EncodesHalfInputAsItsWidening) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (std::size_t n : {0, 1, 7, 64, 65, 1000, 4097, 65537}) {
      auto half_state = codec->make_state(n), wide_state = codec->make_state(n);
      for (std::uint64_t step = 0; step < 3; ++step) {
        const HalfInput h = to_half(dtype, gradient(n, n + step));
        EncodeContext half_ctx = context(step), wide_ctx = context(step);
        half_ctx.state = half_state.get();
        wide_ctx.state = wide_state.get();
        std::vector<std::byte> a(codec->max_encoded_bytes(n)), b(a.size());
        a.resize(codec->encode(h.bits, dtype, a, half_ctx));
        b.resize(codec->encode(h.wide, b, wide_ctx));
        ASSERT_EQ(a, b) << to_string(dtype) << " n=" << n << " step=" << step;
        auto y = decode(*codec, a, n);
        const std::string where = std::string(to_string(dtype)) + " n=" + std::to_string(n);
        // Lossless codecs, and the codec of the input's own format, give the values back.
        if ((dtype == DType::kFloat16 && codec->spec() == "fp16") ||
            (dtype == DType::kBFloat16 && codec->spec() == "bf16")) {
          for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(y[i], h.wide[i]) << where << " i=" << i;
        } else if (step == 0) {  // the bound holds for a fresh state
          expect_within_bound(*codec, GetParam(), h.wide, y, where);
        } else {
          for (std::size_t i = 0; i < n; ++i) ASSERT_TRUE(std::isfinite(y[i])) << where;
        }
      }
      if (half_state) {
        std::vector<std::byte> sa, sb;
        half_state->save(sa);
        wide_state->save(sb);
        EXPECT_EQ(sa, sb) << to_string(dtype) << " n=" << n;
      }
    }
  }
}

TEST_P(CodecContract, RejectsNaNAndInfInHalfInputNamingTheIndex) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    const std::uint16_t nan = dtype == DType::kFloat16 ? 0x7e00 : 0x7fc0;
    const std::uint16_t inf = dtype == DType::kFloat16 ? 0x7c00 : 0x7f80;
    for (std::uint16_t bad : {nan, inf, static_cast<std::uint16_t>(inf | 0x8000)}) {
      for (std::size_t at : {0, 5, 999}) {
        HalfInput h = to_half(dtype, gradient(1000, 5));
        h.bits[at] = bad;
        auto state = codec->make_state(1000);
        EncodeContext ctx;
        ctx.state = state.get();
        std::vector<std::byte> out(codec->max_encoded_bytes(1000));
        try {
          codec->encode(h.bits, dtype, out, ctx);
          FAIL() << to_string(dtype) << ": accepted 0x" << std::hex << bad << " at " << at;
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("element " + std::to_string(at)), std::string::npos)
              << e.what();
        }
      }
    }
  }
}

TEST_P(CodecContract, AccumulateAddsToDestination) {
  auto x = gradient(777, 11);
  auto e = encode(*codec, x);
  auto y = decode(*codec, e.span(), x.size());
  std::vector<float> acc(x.size());
  for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = static_cast<float>(i) * 0.25f;
  auto expect = acc;
  for (std::size_t i = 0; i < acc.size(); ++i) expect[i] += y[i];
  codec->decode(e.span(), acc, DecodeMode::kAccumulate);
  for (std::size_t i = 0; i < acc.size(); ++i) ASSERT_FLOAT_EQ(acc[i], expect[i]) << i;
}

TEST_P(CodecContract, RejectsTruncatedAndOversizedPayloads) {
  auto x = gradient(300, 13);
  auto e = encode(*codec, x);
  for (std::size_t len = 0; len < e.bytes.size(); ++len) {
    std::vector<float> y(x.size());
    EXPECT_THROW(codec->decode(std::span(e.bytes).first(len), y), DecodeError) << "len " << len;
  }
  auto longer = e.bytes;
  longer.push_back(std::byte{0});
  std::vector<float> y(x.size());
  EXPECT_THROW(codec->decode(longer, y), DecodeError);
  std::vector<float> wrong(x.size() + 1);
  EXPECT_THROW(codec->decode(e.span(), wrong), DecodeError);
}

TEST_P(CodecContract, RejectsForeignHeaders) {
  auto x = gradient(64, 17);
  auto e = encode(*codec, x);
  std::vector<float> y(x.size());
  for (std::size_t at : {0, 1, 2, 3, 4, 8, 16}) {  // magic, version, id, digest, count, length
    auto bad = e.bytes;
    bad[at] ^= std::byte{0x40};
    EXPECT_THROW(codec->decode(bad, y), DecodeError) << "byte " << at;
  }
}

// Payloads corrupted after the header, by a random byte flipped or by four bytes set to 0xff (a
// NaN wherever an fp32 value was): each either throws DecodeError, and nothing else, or decodes
// to finite values, writing nothing outside the destination (guard elements on both sides stay
// untouched); and the decoder notices some of them.
TEST_P(CodecContract, RefusesOrContainsCorruptedPayloads) {
  constexpr std::size_t n = 200, guard = 16;
  constexpr float kGuard = -12345.0f;
  auto x = gradient(n, 19);
  auto e = encode(*codec, x);
  ASSERT_GT(e.bytes.size(), Codec::kHeaderBytes);
  const std::size_t payload = e.bytes.size() - Codec::kHeaderBytes;
  std::mt19937 gen(23);
  int detected = 0, trials = 0;
  for (int trial = 0; trial < 2000; ++trial, ++trials) {
    auto bad = e.bytes;
    const std::size_t at = Codec::kHeaderBytes + gen() % payload;
    if (trial % 2 == 0) {
      bad[at] ^= std::byte(static_cast<unsigned char>(1 + gen() % 255));
    } else {
      for (std::size_t i = at; i < std::min(at + 4, bad.size()); ++i) bad[i] = std::byte{0xff};
    }
    std::vector<float> area(n + 2 * guard, kGuard);
    std::span<float> y = std::span(area).subspan(guard, n);
    try {
      codec->decode(bad, y);
    } catch (const DecodeError&) {
      ++detected;
      continue;
    }
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(std::isfinite(y[i])) << "trial " << trial << " byte " << at << " i=" << i;
    }
    for (std::size_t i = 0; i < guard; ++i) {
      ASSERT_EQ(area[i], kGuard) << "wrote before the destination, trial " << trial;
      ASSERT_EQ(area[guard + n + i], kGuard) << "wrote after the destination, trial " << trial;
    }
  }
  EXPECT_GT(detected, 0) << "none of " << trials << " corrupted payloads was refused";
}

TEST_P(CodecContract, DifferentParametersAreRejected) {
  auto x = gradient(64, 29);
  auto e = encode(*codec, x);
  for (const auto& info : registered_codecs()) {
    if (info.name == codec->name()) continue;
    auto other = make_codec(info.name);
    std::vector<float> y(x.size());
    EXPECT_THROW(other->decode(e.span(), y), DecodeError) << info.name;
  }
}

TEST_P(CodecContract, StateSaveRestoreReproducesNextEncoding) {
  auto state = codec->make_state(500);
  if (!state) GTEST_SKIP() << "stateless";
  EncodeContext ctx;
  ctx.seed = 5;
  ctx.tensor = 6;
  ctx.state = state.get();
  for (int step = 0; step < 3; ++step) {
    ctx.step = step;
    encode(*codec, gradient(500, 100 + step), ctx);
  }
  std::vector<std::byte> saved;
  state->save(saved);
  auto restored = codec->make_state(500);
  restored->load(saved);
  ctx.step = 3;
  auto x = gradient(500, 200);
  auto a = encode(*codec, x, ctx);
  EncodeContext ctx2 = ctx;
  ctx2.state = restored.get();
  auto b = encode(*codec, x, ctx2);
  EXPECT_EQ(a.bytes, b.bytes);
  // A state of the wrong size or garbage is refused.
  auto small = codec->make_state(499);
  EXPECT_THROW(small->load(saved), DecodeError);
  saved.resize(saved.size() / 2);
  EXPECT_THROW(restored->load(saved), DecodeError);
}

// Error feedback (ef=1) keeps exactly what was not sent: input plus old residual equals the
// decoded value plus the new residual. Its state is: u32 magic, u64 n, u64 inner state size,
// then the fp32 residual. With momentum=m the input is the momentum u' = m u + x, kept after
// the residual and cleared wherever the decoded value is not zero (what was sent).
TEST_P(CodecContract, ErrorFeedbackAccountingIsExact) {
  if (codec->spec().find("ef=1") == std::string::npos) GTEST_SKIP() << "no error feedback";
  const auto at = codec->spec().find("momentum=");
  const float m = at == std::string::npos ? 0.0f : std::stof(codec->spec().substr(at + 9));
  auto state = codec->make_state(1000);
  EncodeContext ctx;
  ctx.state = state.get();
  std::vector<float> residual(1000, 0.0f), velocity(1000, 0.0f);
  for (int step = 0; step < 4; ++step) {
    ctx.step = step;
    auto x = gradient(1000, 300 + step);
    auto e = encode(*codec, x, ctx);
    auto y = decode(*codec, e.span(), x.size());
    std::vector<std::byte> saved;
    state->save(saved);
    std::vector<float> r_new(1000), u_new(1000);
    ASSERT_GE(saved.size(), 20u + (m > 0 ? 8000u : 4000u));
    std::memcpy(r_new.data(), saved.data() + 20, 4000);
    if (m > 0) std::memcpy(u_new.data(), saved.data() + 20 + 4000, 4000);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float u = m * velocity[i] + x[i];
      float t = (m > 0 ? u : x[i]) + residual[i];
      // r' = t - y and y + r' are rounded at the scale of |y|, which exceeds |t| for codecs
      // that send small elements as +-scale (onebit, tbq, minmax8), and u at its terms'.
      ASSERT_NEAR(t, y[i] + r_new[i],
                  1e-6f * (std::fabs(t) + std::fabs(y[i]) + std::fabs(m * velocity[i]) + 1e-6f))
          << "step " << step;
      if (m > 0) {
        if (y[i] != 0.0f) {
          ASSERT_EQ(u_new[i], 0.0f) << "momentum not cleared where sent, step " << step;
        } else {
          // Rounded at the scale of its terms (fused or not, by target).
          ASSERT_NEAR(u_new[i], u, 1e-6f * (std::fabs(m * velocity[i]) + std::fabs(x[i]) + 1e-6f))
              << "step " << step;
        }
      }
    }
    residual = r_new;
    velocity = u_new;
  }
}

}  // namespace terse::testing
