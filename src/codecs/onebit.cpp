// 1-bit SGD (Seide et al., "1-Bit Stochastic Gradient Descent ...", Interspeech 2014) and
// EF-signSGD (Bernstein et al., "signSGD", ICML 2018; Karimireddy et al., ICML 2019).
// Wire format: header, ceil(n/chunk) fp32 scales (one per chunk), then ceil(n/8) bytes of
// sign bits (bit i%8 of byte i/8 set iff x_i < 0; padding bits 0).
#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/pack.h"
#include "terse/codec.h"

namespace terse {
namespace {

struct OneBitParams {
  std::size_t chunk = 1024;  // elements per scale; 0: one scale for the whole tensor
  bool use_max = false;      // scale = max |x| of the chunk instead of mean |x|
};

OneBitParams read_params(SpecReader& r) {
  OneBitParams p;
  auto chunk = r.integer("chunk", 1024, 0, std::int64_t{1} << 30);
  if (chunk % 8 != 0) {
    throw SpecError(fmt::format("terse: codec 'onebit': chunk={} must be 0 (whole tensor) or a "
                                "multiple of 8",
                                chunk));
  }
  p.chunk = static_cast<std::size_t>(chunk);
  p.use_max = r.choice("scale", "mean", {"mean", "max"}) == "max";
  return p;
}

class OneBitCodec final : public Codec {
 public:
  explicit OneBitCodec(SpecReader& r) : OneBitCodec(read_params(r), r) {}

  CodecTraits traits() const override { return {}; }  // biased, not summable, stateless

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override {
    return 4 * chunks(n) + (n + 7) / 8;
  }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext&) const override {
    const std::size_t n = x.size(), nc = chunks(n);
    auto* scales = out.data();
    auto* bits = reinterpret_cast<std::uint8_t*>(out.data() + 4 * nc);
    const std::size_t len = chunk_len(n);
    for (std::size_t c = 0; c < nc; ++c) {
      const std::size_t start = c * len;
      auto xs = x.subspan(start, std::min(len, n - start));
      kit::SignStats st;
      if (!kit::sign_pack(xs, bits + start / 8, &st)) kit::throw_non_finite(x, spec());
      // mean |x| minimises the L2 error of +-scale given the signs; a zero chunk gets scale 0.
      float scale = p_.use_max ? st.abs_max
                               : static_cast<float>(st.abs_sum / static_cast<double>(xs.size()));
      std::memcpy(scales + 4 * c, &scale, 4);
    }
    return max_payload_bytes(n);
  }

  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const override {
    const std::size_t n = y.size(), nc = chunks(n);
    expect_payload_bytes(in, n, max_payload_bytes(n));
    const auto* bits = reinterpret_cast<const std::uint8_t*>(in.data() + 4 * nc);
    if (n % 8 != 0 && (bits[n / 8] >> (n % 8)) != 0) {
      throw DecodeError(fmt::format("terse: {}: nonzero padding bits", spec()));
    }
    const std::size_t len = chunk_len(n);
    for (std::size_t c = 0; c < nc; ++c) {  // validate every scale before writing anything
      float scale;
      std::memcpy(&scale, in.data() + 4 * c, 4);
      if (!std::isfinite(scale) || std::signbit(scale)) {
        throw DecodeError(fmt::format("terse: {}: chunk {} has invalid scale {}", spec(), c, scale));
      }
    }
    for (std::size_t c = 0; c < nc; ++c) {
      float scale;
      std::memcpy(&scale, in.data() + 4 * c, 4);
      const std::size_t start = c * len;
      kit::sign_unpack(bits + start / 8, scale, y.subspan(start, std::min(len, n - start)),
                       mode == DecodeMode::kAccumulate);
    }
  }

 private:
  OneBitCodec(OneBitParams p, SpecReader& r) : Codec("onebit", 3, r.canonical()), p_(p) {}

  std::size_t chunk_len(std::size_t n) const { return p_.chunk == 0 ? n : p_.chunk; }
  std::size_t chunks(std::size_t n) const {
    if (n == 0) return 0;
    return p_.chunk == 0 ? 1 : (n + p_.chunk - 1) / p_.chunk;
  }

  OneBitParams p_;
};

const bool registered = register_codec(
    {"onebit", 3, "sign bits with a per-chunk scale, mean or max |x| (1 bit/element)",
     [](SpecReader& r) { return std::make_unique<OneBitCodec>(r); }});

}  // namespace
}  // namespace terse
