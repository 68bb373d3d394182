// Identity codec: the fp32 baseline that every compressed codec is measured against.
// Wire format: header, then n little-endian fp32 values.
#include <fmt/format.h>

#include <cstring>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "terse/codec.h"

namespace terse {
namespace {

class NoneCodec final : public Codec {
 public:
  explicit NoneCodec(const SpecReader& r) : Codec(r) {}

  CodecTraits traits() const override {
    CodecTraits t;
    t.lossless = true;
    t.unbiased = true;
    t.summable = true;
    return t;
  }

  void combine(std::span<const std::byte> in, std::span<std::byte> acc) const override {
    std::size_t n = peek(acc).elements;
    auto src = checked_payload(in, n);
    auto dst = checked_payload(acc, n);
    if (src.size() != n * 4 || dst.size() != n * 4) {
      throw DecodeError(fmt::format("terse: none: payload is not {} fp32 values", n));
    }
    if (!kit::store_or_add(reinterpret_cast<const float*>(src.data()),
                           {reinterpret_cast<float*>(const_cast<std::byte*>(dst.data())), n},
                           true)) {
      throw DecodeError("terse: none: payload holds NaN or Inf, which the encoder never produces");
    }
  }

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override { return n * sizeof(float); }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext&) const override {
    if (!kit::copy_finite(x, reinterpret_cast<float*>(out.data()))) {
      kit::throw_non_finite(x, spec());
    }
    return x.size() * sizeof(float);
  }

  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const override {
    expect_payload_bytes(in, y.size(), y.size() * sizeof(float));
    if (!kit::store_or_add(reinterpret_cast<const float*>(in.data()), y,
                           mode == DecodeMode::kAccumulate)) {
      throw DecodeError("terse: none: payload holds NaN or Inf, which the encoder never produces");
    }
  }
};

const bool registered = register_codec(
    {"none", 0, "fp32 identity, the uncompressed baseline",
     [](SpecReader& r) { return std::make_unique<NoneCodec>(r); }});

}  // namespace
}  // namespace terse
