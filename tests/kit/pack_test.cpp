#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kit/pack.h"

namespace terse::kit {
namespace {

std::vector<std::uint8_t> zre_encode(const std::vector<std::uint8_t>& in) {
  std::vector<std::uint8_t> out(in.size() + 1);
  ZeroRunEncoder enc(121, 243, out.data());
  enc.add(in.data(), in.size());
  out.resize(enc.finish());
  return out;
}

TEST(ZeroRun, RunLengthsAroundTheCodeLimits) {
  for (std::size_t run : {1, 2, 3, 13, 14, 15, 16, 27, 28, 29, 100}) {
    std::vector<std::uint8_t> in = {5};
    in.insert(in.end(), run, 121);
    in.push_back(7);
    auto out = zre_encode(in);
    std::vector<std::uint8_t> expect = {5};
    expect.insert(expect.end(), run / 14, 255);
    if (run % 14 >= 2) expect.push_back(static_cast<std::uint8_t>(243 + run % 14 - 2));
    if (run % 14 == 1) expect.push_back(121);
    expect.push_back(7);
    EXPECT_EQ(out, expect) << run;
  }
}

TEST(ZeroRun, RandomStreamsRoundTripInPieces) {
  std::mt19937 gen(3);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::uint8_t> in(gen() % 3000);
    for (auto& b : in) b = gen() % 4 == 0 ? static_cast<std::uint8_t>(gen() % 243) : 121;
    auto enc = zre_encode(in);
    ASSERT_LE(enc.size(), in.size());
    ZeroRunDecoder dec(121, 243, enc);
    std::vector<std::uint8_t> out(in.size(), 0);
    std::size_t pos = 0;
    while (pos < in.size()) {
      std::size_t len = std::min<std::size_t>(in.size() - pos, 1 + gen() % 200);
      bool zero = false;
      bool skip = gen() % 2;
      ASSERT_TRUE(dec.next(out.data() + pos, len, &zero, skip));
      bool expect_zero = std::all_of(in.begin() + pos, in.begin() + pos + len,
                                     [](std::uint8_t b) { return b == 121; });
      ASSERT_EQ(zero, expect_zero);
      if (zero && skip) std::fill(out.begin() + pos, out.begin() + pos + len, 121);
      pos += len;
    }
    EXPECT_TRUE(dec.finished());
    EXPECT_EQ(out, in);
  }
}

TEST(ZeroRun, DetectsShortStreams) {
  std::vector<std::uint8_t> enc = {1, 250};  // 1 then 9 zeros
  ZeroRunDecoder dec(121, 243, enc);
  std::vector<std::uint8_t> out(20);
  bool zero;
  EXPECT_FALSE(dec.next(out.data(), 11, &zero, false));
  ZeroRunDecoder dec2(121, 243, enc);
  EXPECT_TRUE(dec2.next(out.data(), 5, &zero, false));
  EXPECT_FALSE(dec2.finished());  // 5 zeros still pending
}

TEST(PackBits, RoundTripsEveryWidth) {
  std::mt19937 gen(5);
  for (unsigned bits = 1; bits <= 8; ++bits) {
    for (std::size_t n : {0, 1, 7, 8, 9, 63, 100}) {
      std::vector<std::uint8_t> codes(n);
      for (auto& c : codes) c = static_cast<std::uint8_t>(gen() & ((1u << bits) - 1));
      std::vector<std::uint8_t> packed(packed_bytes(n, bits) + 1, 0xAA);
      pack_bits(codes.data(), n, bits, packed.data());
      EXPECT_EQ(packed.back(), 0xAA) << "wrote past the end";
      std::vector<std::uint8_t> back(n);
      unpack_bits(packed.data(), n, bits, back.data());
      EXPECT_EQ(back, codes) << bits << " " << n;
      // bit i*bits+k of the stream is bit k of code i
      for (std::size_t i = 0; i < n; ++i) {
        for (unsigned k = 0; k < bits; ++k) {
          std::size_t at = i * bits + k;
          ASSERT_EQ((packed[at / 8] >> (at % 8)) & 1, (codes[i] >> k) & 1);
        }
      }
    }
  }
}

TEST(SignPack, BitsAndStats) {
  std::vector<float> x(130);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = (i % 3 == 0 ? -1.0f : 1.0f) * i;
  std::vector<std::uint8_t> bits(17, 0xAA);
  SignStats st;
  ASSERT_TRUE(sign_pack(x, bits.data(), &st));
  EXPECT_EQ(bits[16] & ~3u, 0u);  // padding bits zero
  for (std::size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ((bits[i / 8] >> (i % 8)) & 1, x[i] < 0 ? 1 : 0) << i;
  }
  EXPECT_EQ(st.abs_sum, 129.0 * 130 / 2);
  EXPECT_EQ(st.abs_max, 129.0f);
  x[77] = NAN;
  EXPECT_FALSE(sign_pack(x, bits.data(), &st));
}

TEST(Ternary, PlanarLayoutAndValidation) {
  std::vector<float> x(650, 0.0f);
  x[1] = 1;     // group 0, byte 1, digit 0
  x[64] = -1;   // group 0, byte 0, digit 1
  x[645] = 1;   // tail group of 10 elements: s = 2, byte 1, digit 2
  std::vector<std::uint8_t> out(130);
  ternary_pack243(x, 0.5f, out.data());
  EXPECT_EQ(out[0], 121 - 27);
  EXPECT_EQ(out[1], 121 + 81);
  EXPECT_EQ(out[64 + 64 + 1], 121 + 9);
  std::vector<float> y(650);
  ASSERT_TRUE(ternary_unpack243(out.data(), 2.0f, y, false));
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_EQ(y[i], 2 * x[i]) << i;
  out[3] = 243;
  EXPECT_FALSE(ternary_unpack243(out.data(), 2.0f, y, false));
}

}  // namespace
}  // namespace terse::kit
