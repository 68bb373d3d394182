// Natural compression: Horvath et al., "Natural Compression for Distributed Deep Learning", 2019.
// Wire format: header, then one byte `low` (1..128), then one byte per element: bit 7 the sign,
// bits 0..6 a code c; c = 0 is zero, c >= 1 is 2^(low + c - 1 - 127).
#include <fmt/format.h>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/random.h"
#include "terse/codec.h"

namespace terse {
namespace {

class NaturalCodec final : public Codec {
 public:
  explicit NaturalCodec(const SpecReader& r) : Codec(r) {}

  CodecTraits traits() const override {
    CodecTraits t;
    t.unbiased = true;  // except for |x| > 2^127, which rounds down (see natural.md)
    t.stochastic = true;
    return t;
  }

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override { return 1 + n; }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext& ctx) const override {
    int top = kit::natural_top_exponent(x);
    if (top < 0) kit::throw_non_finite(x, spec());
    int low = kit::natural_low_exponent(top);
    out[0] = static_cast<std::byte>(low);
    kit::natural_encode(x, low, ctx.rank_key(), 0,
                        reinterpret_cast<std::uint8_t*>(out.data() + 1));
    return 1 + x.size();
  }

  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const override {
    expect_payload_bytes(in, y.size(), 1 + y.size());
    int low = static_cast<int>(in[0]);
    if (low < 1 || low > 128) {
      throw DecodeError(fmt::format("terse: natural: exponent window base {} not in 1..128", low));
    }
    kit::natural_decode(reinterpret_cast<const std::uint8_t*>(in.data() + 1), low, y,
                        mode == DecodeMode::kAccumulate);
  }
};

const bool registered = register_codec(
    {"natural", 6, "natural compression: stochastic rounding to powers of two (1 byte/element)",
     [](SpecReader& r) { return std::make_unique<NaturalCodec>(r); }});

}  // namespace
}  // namespace terse
