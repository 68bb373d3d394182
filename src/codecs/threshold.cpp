// Threshold sparsification: Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud
// Computing", Interspeech 2015, sending the values themselves rather than +-tau.
// Wire format: header, u32 count, count u32 indices strictly increasing, count fp32 values.
#include <fmt/format.h>

#include <cfloat>
#include <cmath>

#include "terse/codec_kit.h"
#include "kit/basic.h"
#include "kit/random.h"
#include "kit/sparse.h"
#include "terse/codec.h"

namespace terse {
namespace {

struct ThresholdParams {
  float tau = 1e-3f;
  double max_ratio = 0.1;
};

ThresholdParams read_params(SpecReader& r) {
  ThresholdParams p;
  p.tau = static_cast<float>(r.number("tau", 1e-3, 0.0, FLT_MAX));
  p.max_ratio = sparse::read_ratio(r, "max_ratio", 0.1);
  return p;
}

class ThresholdCodec final : public sparse::ListCodec {
 public:
  explicit ThresholdCodec(SpecReader& r) : ThresholdCodec(read_params(r), r) {}

 protected:
  sparse::Rules rules(std::size_t n) const override {
    sparse::Rules r;
    r.max_count = cap(n);
    r.min_key = kit::magnitude_key(p_.tau) + 1;  // every value sent has |v| > tau
    return r;
  }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext& ctx) const override {
    sparse::check_encodable(x.size(), spec());
    const std::size_t limit = cap(x.size());
    const std::uint32_t key = kit::magnitude_key(p_.tau);
    Workspace& ws = ctx.scratch();
    auto idx = ws.get<std::uint32_t>(1, limit + kit::kSelectSlack);
    auto val = ws.get<float>(2, limit + kit::kSelectSlack);
    auto capped = [&] {
      // Send the cap's largest; right whenever they all exceed tau (then at least cap do).
      auto scratch = ws.get<std::uint32_t>(0, kit::top_k_scratch_words(x.size(), limit));
      kit::MagnitudeCut cut;
      if (!kit::top_k(x, limit, scratch, idx.data(), val.data(), &cut)) {
        kit::throw_non_finite(x, spec());
      }
      return cut.key > key;
    };
    if (far_over_cap(x, key, limit) && capped()) {
      return sparse::write(out, idx.data(), val.data(), limit);
    }
    const std::size_t count = kit::select_above(x, key, limit, idx.data(), val.data());
    if (count == kit::kNotFinite) kit::throw_non_finite(x, spec());
    if (count <= limit) return sparse::write(out, idx.data(), val.data(), count);
    capped();  // more than the cap exceed tau, so the cap's largest all do
    return sparse::write(out, idx.data(), val.data(), limit);
  }

 private:
  ThresholdCodec(ThresholdParams p, SpecReader& r)
      : ListCodec(r), p_(p) {}

  std::size_t cap(std::size_t n) const { return sparse::count_for(p_.max_ratio, n); }

  // A glance at 4096 random elements: true when far more than the cap exceed tau, so that the
  // select pass, which would only overflow, is skipped. A wrong guess costs time, not results.
  static bool far_over_cap(std::span<const float> x, std::uint32_t key, std::size_t limit) {
    constexpr std::size_t kGlance = 4096;
    constexpr std::uint64_t kGlanceKey = 0x7468726573686f6cull;
    const std::size_t n = x.size();
    if (n < 8 * kGlance) return false;
    std::size_t above = 0;
    for (std::size_t j = 0; j < kGlance; ++j) {
      above +=
          kit::magnitude_key(x[(std::uint64_t{kit::random_bits(kGlanceKey, j)} * n) >> 32]) > key;
    }
    const double mu =
        static_cast<double>(kGlance) * static_cast<double>(limit) / static_cast<double>(n);
    return static_cast<double>(above) > mu + 4 * std::sqrt(mu) + 8;
  }

  ThresholdParams p_;
};

const bool registered = register_codec(
    {"threshold", 10,
     "every |x| > tau as index and fp32 value (8 bytes each), at most max_ratio * n of them",
     [](SpecReader& r) { return std::make_unique<ThresholdCodec>(r); }});

}  // namespace
}  // namespace terse
