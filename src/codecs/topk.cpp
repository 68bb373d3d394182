// Top-k sparsification: Aji & Heafield, "Sparse Communication for Distributed Gradient Descent",
// EMNLP 2017 (with error feedback: Stich et al., "Sparsified SGD with Memory", NeurIPS 2018).
// Wire format: header, u32 count (= k), k u32 indices strictly increasing, k fp32 values.
#include <fmt/format.h>

#include "terse/codec_kit.h"
#include "kit/basic.h"
#include "kit/sparse.h"
#include "terse/codec.h"

namespace terse {
namespace {

class TopKCodec final : public sparse::ListCodec {
 public:
  explicit TopKCodec(SpecReader& r) : TopKCodec(sparse::read_ratio(r, "ratio", 0.01), r) {}

 protected:
  sparse::Rules rules(std::size_t n) const override {
    sparse::Rules r;
    r.max_count = sparse::count_for(ratio_, n);
    r.exact_count = true;
    return r;
  }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext& ctx) const override {
    sparse::check_encodable(x.size(), spec());
    const std::size_t k = sparse::count_for(ratio_, x.size());
    Workspace& ws = ctx.scratch();
    auto scratch = ws.get<std::uint32_t>(0, kit::top_k_scratch_words(x.size(), k));
    auto idx = ws.get<std::uint32_t>(1, k + kit::kSelectSlack);
    auto val = ws.get<float>(2, k + kit::kSelectSlack);
    if (!kit::top_k(x, k, scratch, idx.data(), val.data())) kit::throw_non_finite(x, spec());
    return sparse::write(out, idx.data(), val.data(), k);
  }

 private:
  TopKCodec(double ratio, SpecReader& r) : ListCodec(r), ratio_(ratio) {}

  double ratio_;
};

const bool registered = register_codec(
    {"topk", 8, "exact top-k by magnitude: k = ratio * n indices and fp32 values (8 bytes each)",
     [](SpecReader& r) { return std::make_unique<TopKCodec>(r); }});

}  // namespace
}  // namespace terse
