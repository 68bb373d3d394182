// QSGD: Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
// Encoding", NeurIPS 2017. Wire format: header, then one fp32 L2 norm per bucket, then per bucket
// the codes level + s (0 .. 2s) in w bits each (w = 2, 4, 8 or 16, the smallest that holds
// 2s + 1 codes) packed by kit::quantize_levels' layout.
#include <fmt/format.h>

#include "codecs/level_codec.h"
#include "kit/random.h"
#include "terse/codec.h"

namespace terse {
namespace {

kit::LevelQuantizer read_quantizer(SpecReader& r) {
  kit::LevelQuantizer q;
  q.norm = kit::BucketNorm::kL2;
  q.bucket = static_cast<std::size_t>(r.integer("bucket", 512, 0, std::int64_t{1} << 40));
  q.levels = static_cast<int>(r.integer("levels", 7, 1, 255));
  q.width = kit::level_code_width(q.levels);
  return q;
}

class QsgdCodec final : public codecs::LevelCodec {
 public:
  explicit QsgdCodec(SpecReader& r) : QsgdCodec(r, read_quantizer(r)) {}

  CodecTraits traits() const override {
    CodecTraits t;
    t.unbiased = true;
    t.stochastic = true;
    return t;
  }

 private:
  // (After read_quantizer(r) has read the parameters: the canonical spec holds what was read.)
  QsgdCodec(SpecReader& r, const kit::LevelQuantizer& q)
      : LevelCodec(
            r, q,
            fmt::format("a norm is negative or not finite, or a code exceeds {}", 2 * q.levels)) {}
};

const bool registered = register_codec(
    {"qsgd", 5, "QSGD: stochastic rounding to s levels of each bucket's L2 norm (sign+level)",
     [](SpecReader& r) { return std::make_unique<QsgdCodec>(r); }});

}  // namespace
}  // namespace terse
