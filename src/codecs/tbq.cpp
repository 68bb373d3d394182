// Threshold binary quantization (Strom, "Scalable Distributed DNN Training Using Commodity GPU
// Cloud Computing", Interspeech 2015; TBQ in HiPress, Bai et al., SOSP 2021).
// Wire format: header, then ceil(n/4) bytes of 2-bit codes, element i at bits 2*(i%4) of byte
// i/4: 00 zero, 01 +tau, 10 -tau (11 never occurs; padding codes 00). tau comes from the spec.
#include <fmt/format.h>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/pack.h"
#include "terse/codec.h"

namespace terse {
namespace {

class TbqCodec final : public Codec {
 public:
  explicit TbqCodec(SpecReader& r)
      : TbqCodec(static_cast<float>(r.number("threshold", 0.01, 1e-30, 1e30)), r) {}

  CodecTraits traits() const override { return {}; }  // biased; use with ef=1

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override { return (n + 3) / 4; }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext&) const override {
    if (!kit::threshold_pack2(x, tau_, reinterpret_cast<std::uint8_t*>(out.data()))) {
      kit::throw_non_finite(x, spec());
    }
    return max_payload_bytes(x.size());
  }

  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const override {
    expect_payload_bytes(in, y.size(), max_payload_bytes(y.size()));
    if (!kit::threshold_unpack2(reinterpret_cast<const std::uint8_t*>(in.data()), tau_, -tau_, y,
                                mode == DecodeMode::kAccumulate)) {
      throw DecodeError(fmt::format("terse: {}: invalid 2-bit code (11) or nonzero padding",
                                    spec()));
    }
  }

 private:
  TbqCodec(float tau, SpecReader& r) : Codec(r), tau_(tau) {}
  float tau_;
};

const bool registered = register_codec(
    {"tbq", 13, "threshold binary quantization: |x| > tau sent as +-tau, 2 bits/element",
     [](SpecReader& r) { return std::make_unique<TbqCodec>(r); }});

}  // namespace
}  // namespace terse
