// QSGD: Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
// Encoding", NeurIPS 2017. Wire format: header, then one fp32 L2 norm per bucket, then per bucket
// the codes level + s (0 .. 2s) in w bits each (w = 2, 4, 8 or 16, the smallest that holds
// 2s + 1 codes) packed by kit::quantize_levels' layout.
#include <fmt/format.h>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/random.h"
#include "terse/codec.h"

namespace terse {
namespace {

class QsgdCodec final : public Codec {
 public:
  explicit QsgdCodec(SpecReader& r) : QsgdCodec(r, read(r)) {}

  CodecTraits traits() const override {
    CodecTraits t;
    t.unbiased = true;
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
          "terse: {}: invalid payload (a norm is negative or not finite, or a code exceeds {})",
          spec(), 2 * q_.levels));
    }
  }

 private:
  struct Params {
    std::size_t bucket;
    int levels;
  };
  static Params read(SpecReader& r) {
    Params p;
    p.bucket = static_cast<std::size_t>(r.integer("bucket", 512, 0, std::int64_t{1} << 40));
    p.levels = static_cast<int>(r.integer("levels", 7, 1, 255));
    return p;
  }
  QsgdCodec(SpecReader& r, Params p) : Codec("qsgd", 5, r.canonical()) {
    q_.norm = kit::BucketNorm::kL2;
    q_.levels = p.levels;
    q_.width = kit::level_code_width(p.levels);
    q_.bucket = p.bucket;
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
    {"qsgd", 5, "QSGD: stochastic rounding to s levels of each bucket's L2 norm (sign+level)",
     [](SpecReader& r) { return std::make_unique<QsgdCodec>(r); }});

}  // namespace
}  // namespace terse
