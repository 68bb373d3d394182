// Random-k sparsification: Wangni et al., "Gradient Sparsification for Communication-Efficient
// Distributed Optimization", NeurIPS 2018; Stich et al., "Sparsified SGD with Memory", 2018.
// Wire format: header, u64 index key, then k fp32 values at the k indices kit::random_k_indices
// draws from that key (the indices themselves are not sent).
#include <fmt/format.h>

#include <cfloat>
#include <cstring>

#include "terse/codec_kit.h"
#include "kit/basic.h"
#include "kit/random.h"
#include "kit/sparse.h"
#include "terse/codec.h"

namespace terse {
namespace {

class RandomKCodec final : public Codec {
 public:
  explicit RandomKCodec(SpecReader& r)
      : RandomKCodec(sparse::read_ratio(r, "ratio", 0.01), r.flag("scale", false), r) {}

  CodecTraits traits() const override {
    CodecTraits t;
    t.unbiased = scale_;
    t.summable = true;  // every rank keeps the same indices: values add position by position
    t.stochastic = true;
    t.sparse = true;
    return t;
  }

  // Element-wise sums in fp32, saturating at +-FLT_MAX so the sum stays a valid encoding.
  void combine(std::span<const std::byte> in, std::span<std::byte> acc) const override {
    const std::size_t n = peek(acc).elements;
    auto src = checked_payload(in, n);
    auto dst = checked_payload(acc, n);
    const std::size_t k = check_payload(src, n);
    check_payload(dst, n);
    if (std::memcmp(src.data(), dst.data(), 8) != 0) {
      throw DecodeError(
          fmt::format("terse: {}: encodings of different steps or tensors keep "
                      "different indices and cannot be combined",
                      spec()));
    }
    auto* out = const_cast<std::byte*>(dst.data()) + 8;
    for (std::size_t t = 0; t < k; ++t) {
      float a, b;
      std::memcpy(&a, src.data() + 8 + 4 * t, 4);
      std::memcpy(&b, out + 4 * t, 4);
      float s = a + b;
      s = s > FLT_MAX ? FLT_MAX : (s < -FLT_MAX ? -FLT_MAX : s);
      std::memcpy(out + 4 * t, &s, 4);
    }
  }

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override {
    return 8 + 4 * sparse::count_for(ratio_, n);
  }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext& ctx) const override {
    const std::size_t n = x.size(), k = sparse::count_for(ratio_, n);
    sparse::check_encodable(n, spec());
    kit::check_finite(x, spec());  // unsent elements too: the policy holds for the whole input
    const std::uint64_t key = ctx.shared_key();
    std::memcpy(out.data(), &key, 8);
    auto idx = ctx.scratch().get<std::uint32_t>(0, k);
    kit::random_k_indices(key, n, k, idx.data());
    const float scale = scale_ ? static_cast<float>(static_cast<double>(n) / k) : 1.0f;
    kit::gather(x, idx.data(), k, scale, out.data() + 8);
    return 8 + 4 * k;
  }

  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const override {
    const std::size_t n = y.size(), k = check_payload(in, n);
    std::uint64_t key;
    std::memcpy(&key, in.data(), 8);
    // decode() has no context: indices go to the calling thread's fallback workspace.
    auto idx = EncodeContext{}.scratch().get<std::uint32_t>(0, k);
    kit::random_k_indices(key, n, k, idx.data());
    kit::scatter(reinterpret_cast<const std::byte*>(idx.data()), in.data() + 8, k, y,
                 mode == DecodeMode::kAccumulate);
  }

 private:
  RandomKCodec(double ratio, bool scale, SpecReader& r)
      : Codec(r), ratio_(ratio), scale_(scale) {}

  // Checks a payload's length and values; returns k.
  std::size_t check_payload(std::span<const std::byte> in, std::size_t n) const {
    if (n > sparse::kMaxElements) {
      throw DecodeError(fmt::format("terse: {}: {} elements are beyond 32-bit indices", spec(), n));
    }
    const std::size_t k = sparse::count_for(ratio_, n);
    expect_payload_bytes(in, n, 8 + 4 * k);
    if (!kit::values_valid(in.data() + 8, k, 0)) {
      throw DecodeError(
          fmt::format("terse: {}: payload holds NaN or Inf, which the encoder "
                      "never produces",
                      spec()));
    }
    return k;
  }

  double ratio_;
  bool scale_;
};

const bool registered = register_codec(
    {"randomk", 9,
     "random k = ratio * n elements from the shared seed: fp32 values only, indices regenerated",
     [](SpecReader& r) { return std::make_unique<RandomKCodec>(r); }});

}  // namespace
}  // namespace terse
