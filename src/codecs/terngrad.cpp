// TernGrad: Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
// Learning", NeurIPS 2017. Wire format: header, then one fp32 scale per chunk, then 2-bit codes
// (0 = -scale, 1 = 0, 2 = +scale) packed by kit::quantize_levels' layout, chunk by chunk.
#include "codecs/level_codec.h"
#include "kit/random.h"
#include "terse/codec.h"

namespace terse {
namespace {

kit::LevelQuantizer read_quantizer(SpecReader& r) {
  kit::LevelQuantizer q;
  q.norm = kit::BucketNorm::kMaxAbs;
  q.bucket = static_cast<std::size_t>(r.integer("chunk", 0, 0, std::int64_t{1} << 40));
  q.clip = static_cast<float>(r.number("clip", 0.0, 0.0, 100.0));
  q.levels = 1;
  q.width = 2;
  return q;
}

class TernGradCodec final : public codecs::LevelCodec {
 public:
  explicit TernGradCodec(SpecReader& r) : TernGradCodec(r, read_quantizer(r)) {}

  CodecTraits traits() const override {
    CodecTraits t;
    t.unbiased = settings().clip == 0;  // clipping trades bias for variance
    t.stochastic = true;
    return t;
  }

 private:
  // (After read_quantizer(r) has read the parameters: the canonical spec holds what was read.)
  TernGradCodec(SpecReader& r, const kit::LevelQuantizer& q)
      : LevelCodec(r, q, "a scale is negative or not finite, or a code is 3") {}
};

const bool registered = register_codec(
    {"terngrad", 4, "TernGrad: stochastic ternary {-s, 0, s} per chunk (2 bits/element)",
     [](SpecReader& r) { return std::make_unique<TernGradCodec>(r); }});

}  // namespace
}  // namespace terse
