// The contract every registered codec keeps: round trips of every size, the non-finite policy,
// validated payloads, accumulate mode, and error-feedback accounting. Codec-specific properties
// (error bounds, unbiasedness, known vectors) are in each codec's own test file.
#include <gtest/gtest.h>

#include <cmath>

#include "codec_testing.h"
#include "kit/basic.h"
#include "terse/codec.h"

namespace terse {
namespace {

using testing::decode;
using testing::encode;
using testing::gradient;

std::vector<std::string> all_specs() {
  std::vector<std::string> specs;
  for (const auto& info : registered_codecs()) {
    specs.push_back(info.name);
    auto c = make_codec(info.name);
    // Round codecs (PowerSGD) and DGC have error feedback built in and refuse ef=1.
    const CodecTraits t = c->traits();
    if (!t.lossless && !t.multi_round && !t.builtin_feedback) specs.push_back(info.name + ":ef=1");
  }
  return specs;
}

class CodecContract : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<Codec> codec = make_codec(GetParam());
};

TEST_P(CodecContract, RoundTripsEverySize) {
  for (std::size_t n : {0, 1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 1000, 4097,
                        65537}) {
    auto x = gradient(n, n + 1);
    auto e = encode(*codec, x);
    EXPECT_LE(e.bytes.size(), codec->max_encoded_bytes(n)) << "n=" << n;
    auto y = decode(*codec, e.span(), n);
    double err = 0, norm = 0;
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(std::isfinite(y[i])) << "n=" << n << " i=" << i;
      err += (y[i] - x[i]) * (y[i] - x[i]);
      norm += x[i] * x[i];
    }
    if (codec->traits().lossless) {
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(x[i], y[i]) << "n=" << n << " i=" << i;
    }
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
HalfInput to_half(DType dtype, std::span<const float> x) {
  HalfInput h{std::vector<std::uint16_t>(x.size()), std::vector<float>(x.size())};
  EXPECT_TRUE(kit::narrow(dtype, x, h.bits.data()));
  EXPECT_TRUE(kit::widen(dtype, h.bits.data(), h.wide, false));
  return h;
}

// Encoding fp16 or bf16 values gives the bytes of encoding their fp32 widening, step after step
// with the same state (error-feedback residuals stay fp32), so every strategy's results on half
// tensors are the fp32 path's on the rounded values, and decoding gives the fp32 path's error.
TEST_P(CodecContract, EncodesHalfInputAsItsWidening) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (std::size_t n : {0, 1, 7, 64, 65, 1000, 4097, 65537}) {
      auto half_state = codec->make_state(n), wide_state = codec->make_state(n);
      for (std::uint64_t step = 0; step < 3; ++step) {
        const HalfInput h = to_half(dtype, gradient(n, n + step));
        EncodeContext half_ctx = testing::context(step), wide_ctx = testing::context(step);
        half_ctx.state = half_state.get();
        wide_ctx.state = wide_state.get();
        std::vector<std::byte> a(codec->max_encoded_bytes(n)), b(a.size());
        a.resize(codec->encode(h.bits, dtype, a, half_ctx));
        b.resize(codec->encode(h.wide, b, wide_ctx));
        ASSERT_EQ(a, b) << to_string(dtype) << " n=" << n << " step=" << step;
        auto y = decode(*codec, a, n);
        double err = 0, norm = 0;
        for (std::size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(std::isfinite(y[i]));
          err += (y[i] - h.wide[i]) * (y[i] - h.wide[i]);
          norm += h.wide[i] * h.wide[i];
        }
        // Lossless codecs, and the codec of the input's own format, give the values back.
        const bool exact = codec->traits().lossless ||
                           (dtype == DType::kFloat16 && codec->spec() == "fp16") ||
                           (dtype == DType::kBFloat16 && codec->spec() == "bf16");
        if (exact) {
          ASSERT_EQ(err, 0.0) << to_string(dtype) << " n=" << n;
        }
        // No codec's error exceeds the input's own norm by more than the sparse codecs' rescaling.
        EXPECT_LE(err, 1e4 * norm + 1e-12) << to_string(dtype) << " n=" << n;
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
          EXPECT_NE(std::string(e.what()).find("element " + std::to_string(at)),
                    std::string::npos)
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

TEST_P(CodecContract, SurvivesRandomCorruption) {
  // Any byte flipped after the header: decode either throws DecodeError or writes finite or
  // non-finite values into y, but never outside it (checked under ASan in CI).
  auto x = gradient(200, 19);
  auto e = encode(*codec, x);
  std::mt19937 gen(23);
  for (int trial = 0; trial < 2000 && e.bytes.size() > 24; ++trial) {
    auto bad = e.bytes;
    std::size_t at = 24 + gen() % (bad.size() - 24);
    bad[at] ^= std::byte(static_cast<unsigned char>(1 + gen() % 255));
    std::vector<float> y(x.size());
    try {
      codec->decode(bad, y);
    } catch (const DecodeError&) {
    }
  }
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
    testing::encode(*codec, gradient(500, 100 + step), ctx);
  }
  std::vector<std::byte> saved;
  state->save(saved);
  auto restored = codec->make_state(500);
  restored->load(saved);
  ctx.step = 3;
  auto x = gradient(500, 200);
  auto a = testing::encode(*codec, x, ctx);
  EncodeContext ctx2 = ctx;
  ctx2.state = restored.get();
  auto b = testing::encode(*codec, x, ctx2);
  EXPECT_EQ(a.bytes, b.bytes);
  // A state of the wrong size or garbage is refused.
  auto small = codec->make_state(499);
  EXPECT_THROW(small->load(saved), DecodeError);
  saved.resize(saved.size() / 2);
  EXPECT_THROW(restored->load(saved), DecodeError);
}

TEST_P(CodecContract, ErrorFeedbackAccountingIsExact) {
  if (codec->spec().find("ef=1") == std::string::npos) GTEST_SKIP() << "no error feedback";
  auto state = codec->make_state(1000);
  EncodeContext ctx;
  ctx.state = state.get();
  std::vector<float> residual(1000, 0.0f);
  for (int step = 0; step < 4; ++step) {
    ctx.step = step;
    auto x = gradient(1000, 300 + step);
    auto e = testing::encode(*codec, x, ctx);
    auto y = decode(*codec, e.span(), x.size());
    std::vector<std::byte> saved;
    state->save(saved);
    std::vector<float> r_new(1000);
    std::memcpy(r_new.data(), saved.data() + 20, 4000);  // magic, n, inner size, residual
    for (std::size_t i = 0; i < x.size(); ++i) {
      float t = x[i] + residual[i];
      // r' = t - y and y + r' are rounded at the scale of |y|, which exceeds |t| for codecs
      // that send small elements as +-scale (onebit, tbq, minmax8).
      ASSERT_NEAR(t, y[i] + r_new[i], 1e-6f * (std::fabs(t) + std::fabs(y[i]) + 1e-6f))
          << "step " << step;
    }
    residual = r_new;
  }
}

INSTANTIATE_TEST_SUITE_P(AllCodecs, CodecContract, ::testing::ValuesIn(all_specs()),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (auto& c : s) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return s;
                         });

TEST(CodecRegistry, UnknownNamesAndKeysListWhatIsAllowed) {
  try {
    make_codec("nosuchcodec");
    FAIL();
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("fp16"), std::string::npos) << e.what();
  }
  try {
    make_codec("fp16:ratio=0.1");
    FAIL();
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("ratio"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make_codec("fp16:"), SpecError);
  EXPECT_THROW(make_codec("fp16:ef"), SpecError);
  EXPECT_THROW(make_codec("none:ef=1"), SpecError);
  EXPECT_THROW(make_codec("fp16:ef=1,ef=0"), SpecError);
}

}  // namespace
}  // namespace terse
