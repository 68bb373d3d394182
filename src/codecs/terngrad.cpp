// TernGrad: Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
// Learning", NeurIPS 2017. Wire format: header, then one fp32 scale per chunk, then 2-bit codes
// (0 = -scale, 1 = 0, 2 = +scale) packed by kit::quantize_levels' layout, chunk by chunk.
#include <fmt/format.h>

#include <cstring>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/random.h"
#include "terse/codec.h"

namespace terse {
namespace {

class TernGradCodec final : public Codec {
 public:
  explicit TernGradCodec(SpecReader& r) : TernGradCodec(r, read(r)) {}

  CodecTraits traits() const override {
    CodecTraits t;
    t.unbiased = q_.clip == 0;  // clipping trades bias for variance
    t.stochastic = true;
    return t;
  }

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override {
    return chunks(n) * sizeof(float) + kit::packed_bucket_bytes(n, bucket(n), q_.width);
  }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext& ctx) const override {
    const std::size_t n = x.size(), nc = chunks(n);
    auto* codes = reinterpret_cast<std::uint8_t*>(out.data() + nc * sizeof(float));
    if (!kit::quantize_levels(quantizer(n), x, ctx.rank_key(), 0, out.data(), codes)) {
      kit::throw_non_finite(x, spec());
    }
    return max_payload_bytes(n);
  }

  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const override {
    const std::size_t n = y.size(), nc = chunks(n);
    if (in.size() != max_payload_bytes(n)) {
      throw DecodeError(fmt::format("terse: {}: payload of {} bytes for {} elements (expected {})",
                                    spec(), in.size(), n, max_payload_bytes(n)));
    }
    const auto* codes = reinterpret_cast<const std::uint8_t*>(in.data() + nc * sizeof(float));
    if (!kit::dequantize_levels(quantizer(n), codes, in.data(), y,
                                mode == DecodeMode::kAccumulate)) {
      throw DecodeError(fmt::format(
          "terse: {}: invalid payload (a scale is negative or not finite, or a code is 3)",
          spec()));
    }
  }

 private:
  struct Params {
    std::size_t chunk;
    float clip;
  };
  static Params read(SpecReader& r) {
    Params p;
    p.chunk = static_cast<std::size_t>(r.integer("chunk", 0, 0, std::int64_t{1} << 40));
    p.clip = static_cast<float>(r.number("clip", 0.0, 0.0, 100.0));
    return p;
  }
  TernGradCodec(SpecReader& r, Params p) : Codec("terngrad", 4, r.canonical()) {
    q_.norm = kit::BucketNorm::kMaxAbs;
    q_.clip = p.clip;
    q_.levels = 1;
    q_.width = 2;
    q_.bucket = p.chunk;
  }
  kit::LevelQuantizer quantizer(std::size_t n) const {
    kit::LevelQuantizer q = q_;
    q.bucket = bucket(n);
    return q;
  }
  std::size_t bucket(std::size_t n) const { return q_.bucket == 0 ? (n == 0 ? 1 : n) : q_.bucket; }
  std::size_t chunks(std::size_t n) const { return (n + bucket(n) - 1) / bucket(n); }

  kit::LevelQuantizer q_;
};

const bool registered = register_codec(
    {"terngrad", 4, "TernGrad: stochastic ternary {-s, 0, s} per chunk (2 bits/element)",
     [](SpecReader& r) { return std::make_unique<TernGradCodec>(r); }});

}  // namespace
}  // namespace terse
